"""A model's exact joint distribution of its first tokens, from full trunk forwards in float64 (the oracle of the
sampled decode tests)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtplx_ext import SamplerConfig
from mtplx_ext.sampling import counts_with, distribution_from_logits


def expected_joint(rt, prompt: list[int], cfg: SamplerConfig) -> np.ndarray:
    """P(t1) p(t2 | t1) from full forwards of the trunk, in float64."""
    V = rt.vocab_size
    last = lambda toks: np.array(rt.trunk(mx.array([toks]))[0, -1].astype(mx.float32), np.float64)  # noqa: E731
    p1 = distribution_from_logits(last(prompt), cfg, None)
    joint = np.zeros((V, V))
    for t1 in np.flatnonzero(p1):
        joint[t1] = p1[t1] * distribution_from_logits(last(prompt + [int(t1)]), cfg, counts_with(None, V, [t1]))
    return joint


def expected_chain_joint(rt, prompt: list[int], cfg: SamplerConfig, n: int) -> np.ndarray:
    """P(t_1..t_n) = prod_i p(t_i | prompt, t_<i) from full forwards of the trunk, float64, flat [V**n]."""
    V = rt.vocab_size
    joint = np.ones(1)
    prefixes = [[]]
    for _ in range(n):
        logits = rt.trunk(mx.array([prompt + p for p in prefixes]))[:, -1].astype(mx.float32)
        rows = np.array(logits, np.float64)
        step = np.stack([distribution_from_logits(rows[i], cfg, counts_with(None, V, p)) for i, p in enumerate(prefixes)])
        joint = (joint[:, None] * step).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(V)]
    return joint
