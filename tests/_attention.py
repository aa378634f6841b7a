"""The float64 attention reference the attention kernels' tests share."""

from __future__ import annotations

import numpy as np


def sdpa_ref(q, k, v, scale: float, mask, lowest: float) -> np.ndarray:
    """float64 attention; mask None, "causal", bool or additive (numpy)."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    kk = np.repeat(k, rep, axis=1)
    vv = np.repeat(v, rep, axis=1)
    scores = np.einsum("bhtd,bhsd->bhts", q, kk) * scale
    if isinstance(mask, str):
        mask = np.arange(T)[:, None] + (S - T) >= np.arange(S)[None, :]
    if mask is not None and mask.dtype == np.bool_:
        # A masked score becomes the dtype's lowest value: a fully masked row
        # is then uniform.
        scores = np.where(np.broadcast_to(mask, scores.shape), scores, lowest)
    elif mask is not None:
        scores = scores + mask
    with np.errstate(invalid="ignore"):
        m = scores.max(axis=-1, keepdims=True)
        p = np.exp(scores - m)
        p = p / p.sum(axis=-1, keepdims=True)
        out = np.einsum("bhts,bhsd->bhtd", p, vv)
    bad = ~np.isfinite(m) | np.isnan(scores).any(axis=-1, keepdims=True)
    return np.where(bad, np.nan, out)


__all__ = ["sdpa_ref"]
