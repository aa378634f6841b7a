"""Statistical exactness of sampled MTP verification through the fused primitives.

A toy model with a small vocabulary: a primary distribution P(t1), a
prefix-dependent target p(t2 | t1) and a draft q(t2 | t1) far from it. Each of
N >= 100,000 cycles runs in one large batch through sample_tokens (x0, then
the draft) and verify_sampled. The committed pair (x0, second) must follow
P(t1) p(t2 | t1) after the sampler's transforms (G-test: p >= 1e-5, `_stats.ALPHA_EXACT`, and no
pair outside the kept sets), and the acceptance rate must lie within 5 sigma
of sum_t1 P(t1) sum_t min(p, q). The same test run on deliberately broken
rules (`_broken_rules`: the exact rule with one change, fed the same
drafts and uniforms) must reject them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.sampling import SamplerConfig, counts_with, distribution_from_logits, pack_params
from _broken_rules import sampled_chain
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue
import _seed

N = 100_000

EXACT = "exact"


class ToyModel:
    """Logit tables of a V-token toy: primary, target(t1), draft(t1)."""

    def __init__(self, rng: np.random.Generator, V: int):
        self.V = V
        self.primary = rng.normal(size=V) * 1.5
        self.target = rng.normal(size=(V, V)) * 2.0
        # Far from the target: independent, flatter, and shifted.
        self.draft = rng.normal(size=(V, V)) * 1.2 + np.linspace(1.5, -1.5, V)
        self.bonus = rng.normal(size=(V, V)) * 2.0
        self.counts = (rng.random(V) < 0.3).astype(np.int32) * rng.integers(1, 3, size=V).astype(np.int32)
        # float32 round trip: the reference must see the values the kernels see.
        for name in ("primary", "target", "draft", "bonus"):
            setattr(self, name, getattr(self, name).astype(np.float32).astype(np.float64))

    def expected(self, cfg: SamplerConfig) -> tuple[np.ndarray, float]:
        """Joint P(t1) p(t2 | t1) and the expected acceptance rate."""
        V = self.V
        P = distribution_from_logits(self.primary, cfg, self.counts)
        joint = np.zeros((V, V))
        acc = 0.0
        for t1 in range(V):
            if P[t1] == 0:
                continue
            c1 = counts_with(self.counts, V, [t1])
            p = distribution_from_logits(self.target[t1], cfg, c1)
            q = distribution_from_logits(self.draft[t1], cfg, c1)
            joint[t1] = P[t1] * p
            acc += P[t1] * np.minimum(p, q).sum()
        return joint, acc

    def run(self, cfg: SamplerConfig, seed: int, rule: str = EXACT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """N cycles in one batch: (x0, second, accept) per cycle (the primitive, or a broken `rule`)."""
        V = self.V
        params = mx.array(pack_params(cfg, N))
        counts = mx.broadcast_to(mx.array(self.counts)[None], (N, V))
        key = mx.random.key(seed)
        k0, k1, k2 = mx.random.split(key, 3)
        primary = mx.broadcast_to(mx.array(self.primary, mx.float32)[None], (N, V))
        x0 = mtplx_ext.sample_tokens(primary, mx.random.uniform(shape=(N,), key=k0), params, token_counts=counts)
        draft_logits = mx.array(self.draft, mx.float32)[x0]
        d = mtplx_ext.sample_tokens(
            draft_logits, mx.random.uniform(shape=(N,), key=k1), params, token_counts=counts, extra_tokens=x0[:, None]
        )
        vl = mx.stack([mx.array(self.target, mx.float32)[x0], mx.array(self.bonus, mx.float32)[d]], axis=1)
        u = mx.random.uniform(shape=(N, 3), key=k2)
        if rule != EXACT:  # the chain bundle of K = 1: (x0, accepted, second, bonus)
            c = sampled_chain(np.array(vl), np.array(draft_logits)[:, None], np.array(mx.stack([x0, d], 1)),
                              np.array(u), cfg, self.counts, rule)
            return c[:, 0], c[:, 2], c[:, 1]
        b = np.array(mtplx_ext.verify_sampled(vl, draft_logits, mx.stack([x0, d], 1), u, params, token_counts=counts))
        return b[:, 0], b[:, 2], b[:, 3]


def check(model: ToyModel, cfg: SamplerConfig, seed: int, rule: str = EXACT) -> tuple[float, float]:
    """(G-test p-value of the committed pairs, acceptance z-score)."""
    x0, second, accept = model.run(cfg, seed, rule)
    assert np.all(accept >= 0), "no row may be flagged unusable"
    joint, acc = model.expected(cfg)
    observed = np.bincount(x0 * model.V + second, minlength=model.V**2)
    p = g_test_pvalue(observed, joint.reshape(-1))
    sigma = np.sqrt(acc * (1 - acc) / N)
    if sigma == 0:
        # A certain outcome (q == p after the cuts): the rate must match exactly.
        return p, 0.0 if accept.mean() == acc else float("inf")
    z = (accept.mean() - acc) / sigma
    return p, float(z)


SETTINGS = {
    "plain": SamplerConfig(temperature=1.0),
    "cold_top_k": SamplerConfig(temperature=0.6, top_k=5),
    "hot_top_p": SamplerConfig(temperature=1.7, top_p=0.75),
    "min_p": SamplerConfig(temperature=1.2, min_p=0.08),
    "all_cuts_penalties": SamplerConfig(
        temperature=0.8, top_k=9, top_p=0.9, min_p=0.02, presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.3
    ),
}


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_committed_pairs_follow_the_target_and_acceptance_matches_overlap(rng, name):
    V = int(rng.integers(8, 17))
    model = ToyModel(rng, V)
    p, z = check(model, SETTINGS[name], int(rng.integers(2**31)))
    assert p >= ALPHA_EXACT, f"G-test rejects the exact sampler: p = {p:.2e}"
    assert abs(z) < 5, f"acceptance rate off by {z:.1f} sigma"


@pytest.mark.parametrize(
    "rule, cfg",
    [
        ("residual_from_target", SamplerConfig(temperature=1.0)),
        ("top_p_only_at_bonus", SamplerConfig(temperature=1.5, top_p=0.6)),
        ("draft_without_temperature", SamplerConfig(temperature=0.5)),
    ],
    ids=["residual_from_target", "top_p_only_at_bonus", "draft_without_temperature"],
)
def test_same_test_rejects_deliberately_broken_pipelines(rng, rule, cfg):
    # A model whose cuts leave a single possible pair cannot tell any
    # pipeline from another: draw one with a choice left.
    while True:
        model = ToyModel(rng, int(rng.integers(8, 17)))
        if np.count_nonzero(model.expected(cfg)[0]) >= 2:
            break
    seed = int(rng.integers(2**31))
    # The exact pipeline passes on this very model and seed ...
    p_exact, _ = check(model, cfg, seed)
    assert p_exact >= ALPHA_EXACT
    # ... and the broken one, driven by the same drafts and uniforms, fails.
    p_broken, _ = check(model, cfg, seed, rule)
    assert p_broken < ALPHA_BROKEN, f"broken rule {rule} not detected: p = {p_broken:.2e}"
