"""Deliberately broken speculative-sampling rules, for the statistical tests to reject.

The shipped kernels carry the exact rule only. A statistical test proves its
power by rejecting a wrong rule run through the same test: here each wrong
rule is the exact chain rule of `mtplx_ext.sampling.sample_mtp_chain_row`
(float64, the definition every kernel follows) with one change, run over
every row at once. With `rule="exact"` it is that definition, and
`tests/sampling/test_broken_rules.py` checks it commits what the kernels
commit from the same uniforms, so each broken rule differs from the shipped
rule by its one change only.

Rows are (x0, d_1..d_K) with their verification and draft logits, as the
kernels take them; one sampler for every row (the tests' toy models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
import numpy as np

from mtplx_ext.sampling import SamplerConfig, counts_with, distribution_from_logits

#: The exact rule, then each broken one (what it gets wrong).
RULES = (
    "exact",
    "residual_from_target",  # on rejection draw from p, not max(p - q, 0)
    "residual_unnormalised",  # residual drawn as if its mass were 1
    "top_p_only_at_bonus",  # p and q at the draft positions skip top-p
    "draft_without_temperature",  # q computed at temperature 1
    "bonus_from_draft",  # bonus drawn from the last draft row, not p_{K+1}
    "accept_with_next_target",  # accept test against p_{i+1} instead of p_i
    "bias_not_in_residual",  # the residual drawn from the unbiased p
    "bias_not_in_draft",  # q without the bias the drafts were sampled with
)

_ONE_BELOW = float(np.nextafter(1.0, 0.0))


class _Dists:
    """Distributions of logit rows under a sampler, one computation per distinct (row, prefix)."""

    def __init__(self, cfg: SamplerConfig, counts: np.ndarray | None, V: int):
        self.cfg, self.counts, self.V = cfg, counts, V
        self.penalties = cfg.has_penalties
        self._memo: dict[tuple, np.ndarray] = {}

    def rows(self, logits: np.ndarray, prefixes: np.ndarray, cfg: SamplerConfig | None = None) -> np.ndarray:
        """[N, V] float64: row n's distribution from logits[n] with counts + prefixes[n]."""
        cfg = self.cfg if cfg is None else cfg
        out = np.empty((len(logits), self.V))
        for n, (row, pre) in enumerate(zip(logits, prefixes)):
            key = (id(cfg), row.tobytes(), tuple(pre.tolist()) if self.penalties else ())
            d = self._memo.get(key)
            if d is None:
                c = counts_with(self.counts, self.V, pre.tolist())
                d = self._memo[key] = distribution_from_logits(row.astype(np.float64), cfg, c)
            out[n] = d
        return out


def _clamp(u: np.ndarray) -> np.ndarray:
    u = np.asarray(u, np.float64)
    return np.where(u >= 0.0, np.minimum(u, _ONE_BELOW), 0.0)


def _draw(w: np.ndarray, u: np.ndarray, normalised: bool = True) -> np.ndarray:
    """Inverse-CDF draws in vocabulary order (`reference.sample_from`), one per row of weights `w`."""
    c = np.cumsum(w, axis=1)
    target = _clamp(u) * (c[:, -1] if normalised else 1.0)
    t = (c <= target[:, None]).sum(axis=1)
    last = w.shape[1] - 1 - np.argmax((w > 0)[:, ::-1], axis=1)
    return np.where(t >= w.shape[1], last, t)


def sampled_chain(
    verify_logits: np.ndarray,
    draft_logits: np.ndarray,
    tokens: np.ndarray,
    uniforms: np.ndarray,
    cfg: SamplerConfig,
    counts: np.ndarray | None = None,
    rule: str = "exact",
) -> np.ndarray:
    """The chain bundle [N, K + 3] (x0, n, c_1..c_{K+1}; -1 past n + 1) of `rule`.

    Args:
        verify_logits: [N, K + 1, V]; draft_logits: [N, K, V]; tokens:
            [N, K + 1] (x0, d_1..d_K), all valid; uniforms: [N, K + 2]
            (u_accept_1..K, u_resample, u_bonus).
        cfg: every row's sampler (its logit bias included); counts: [V]
            counts before x0 shared by every row, or None.
        rule: one of `RULES`.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    vl, dl = np.asarray(verify_logits), np.asarray(draft_logits)
    toks, u = np.asarray(tokens, np.int64), np.asarray(uniforms, np.float64)
    N, T, V = vl.shape
    K = T - 1
    exact = _Dists(cfg, counts, V)
    unbiased = replace(cfg, logit_bias={})
    no_top_p = replace(cfg, top_p=1.0)
    hot = replace(cfg, temperature=1.0) if cfg.temperature > 0 else cfg
    p_cfg = no_top_p if rule == "top_p_only_at_bonus" else cfg
    q_cfg = {"top_p_only_at_bonus": no_top_p, "draft_without_temperature": hot, "bias_not_in_draft": unbiased}.get(
        rule, cfg)
    out = np.full((N, K + 3), -1, np.int64)
    out[:, 0] = toks[:, 0]
    n = np.zeros(N, np.int64)
    live = np.ones(N, bool)  # every draft so far accepted
    rows = np.arange(N)
    for i in range(1, K + 1):
        r = rows[live]
        pre = toks[r, :i]
        P = exact.rows(vl[r, i - 1], pre, p_cfg)
        Q = exact.rows(dl[r, i - 1], pre, q_cfg)
        d = toks[r, i]
        P_acc = exact.rows(vl[r, i], pre, p_cfg) if rule == "accept_with_next_target" else P
        j = np.arange(len(r))
        acc = _clamp(u[r, i - 1]) * Q[j, d] < P_acc[j, d]
        out[r[acc], 1 + i] = d[acc]
        n[r[acc]] = i
        rej = ~acc
        if rej.any():
            rr = r[rej]
            P_res = exact.rows(vl[rr, i - 1], pre[rej], unbiased) if rule == "bias_not_in_residual" else P[rej]
            R = np.maximum(P_res - Q[rej], 0.0)
            empty = R.sum(axis=1) <= 0
            if rule == "residual_from_target":
                R = P_res
            R[empty] = P_res[empty]
            t = _draw(R, u[rr, K])
            if rule == "residual_unnormalised":
                t = np.where(empty, t, _draw(R, u[rr, K], normalised=False))
            out[rr, 1 + i] = t
        live[r[rej]] = False
    r = rows[live]
    if r.size:
        bonus_rows = dl[r, K - 1] if rule == "bonus_from_draft" else vl[r, K]
        Pb = exact.rows(bonus_rows, toks[r], cfg)
        out[r, 2 + K] = _draw(Pb, u[r, K + 1])
    out[:, 1] = n
    return out


def target_one_position_late(verify_chain: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """`verify_chain` (the chain primitive's signature) fed each position's target one position late.

    Draft i is tested against, and on rejection resampled from, p_{i+1}
    instead of p_i: a broken rule built from graph ops only, so a decode's
    compiled steps can run it.
    """

    def broken(verify_logits: mx.array, *args, **kwargs) -> mx.array:
        late = mx.concatenate([verify_logits[:, 1:], verify_logits[:, -1:]], axis=1)
        return verify_chain(late, *args, **kwargs)

    return broken


__all__ = ["RULES", "sampled_chain", "target_one_position_late"]
