"""The per-row logit bias of the fused CPU kernels (sample_tokens, verify_sampled_chain, verify_greedy_chain).

The float64 references of mtplx_ext.sampling apply `SamplerConfig.logit_bias`
(added in float32 before the penalties), so each kernel run with the packed
bias must equal the reference token for token on fresh random inputs;
outputs are poisoned before the kernels write them. A G-test shows that
sampled chains with a bias follow the biased target's joint distribution,
and rejects two deliberately broken rules: the residual drawn from the
unbiased target, and q computed without the bias the drafts were sampled
with.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.ops.greedy_verify import verify_greedy_chain
from mtplx_ext.ops.sampled_verify import sample_tokens, verify_sampled_chain
from mtplx_ext.sampling import (
    SamplerConfig,
    biased_logits,
    counts_with,
    greedy_chain_row,
    pack_logit_bias,
    sample_from,
    sample_mtp_chain_row,
    transform_row,
)
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue
from test_chain_stats import Bigram
from test_chain_verify import _run, chain_ambiguous, expected_bundle, greedy_case, sampled_case
from test_sampling_fused import DTYPES, TOL, cdf_ambiguous, kept_ambiguous, random_counts, random_logits, host

BIAS_NOT_IN_RESIDUAL, BIAS_NOT_IN_DRAFT = 4, 5


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()


def random_bias(rng: np.random.Generator, V: int) -> dict[int, float]:
    """No bias, a few moderate entries, or +-100 on some tokens; some ids past V."""
    kind = rng.choice(["none", "moderate", "extreme"], p=[0.2, 0.5, 0.3])
    if kind == "none":
        return {}
    n = int(rng.integers(1, min(V, 12) + 1))
    ids = rng.choice(V, size=n, replace=False).tolist()
    if rng.random() < 0.3:
        ids.append(V + int(rng.integers(0, 5)))  # outside the vocabulary: adds nothing
    if kind == "moderate":
        return {int(t): float(rng.uniform(-5, 5)) for t in ids}
    return {int(t): float(rng.choice([-100.0, 100.0, rng.uniform(-100, 100)])) for t in ids}


def with_bias(cfg: SamplerConfig, bias: dict[int, float]) -> SamplerConfig:
    return dataclasses.replace(cfg, logit_bias=bias)


def bias_arrays(cfgs: list[SamplerConfig]) -> tuple[mx.array, mx.array]:
    packed = pack_logit_bias(cfgs, width=max(8, max(len(c.logit_bias) for c in cfgs)))
    assert packed is not None
    return mx.array(packed[0]), mx.array(packed[1])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sampled_chain_with_bias_equals_float64_reference(rng, dtype):
    compared = skipped = 0
    ns = []
    for K in (1, 2, 4):
        for V, B in ((int(rng.integers(3, 40)), 8), (int(rng.integers(200, 3000)), 6), (int(rng.integers(20000, 30000)), 2)):
            vl, dl, vh, dh, tok, u, counts, cfgs = sampled_case(rng, B, K, V, DTYPES[dtype], rng.random() < 0.6)
            cfgs = [with_bias(c, random_bias(rng, V)) for c in cfgs]
            # Drafts as the biased drafter draws them (the case drew them unbiased).
            for b in range(B):
                for i in range(1, K + 1):
                    if 0 <= tok[b, i] < V and np.isfinite(dh[b, i - 1]).all() and rng.random() < 0.8:
                        c = counts_with(counts[b], V, [t for t in tok[b, :i] if 0 <= t < V])
                        tok[b, i] = sample_from(transform_row(dh[b, i - 1], cfgs[b], c).p, rng.random())
            out = _run(
                verify_sampled_chain, vl, dl, mx.array(tok), mx.array(u), cfgs, mx.array(counts),
                logit_bias=bias_arrays(cfgs),
            )
            for b in range(B):
                if chain_ambiguous(vh[b], dh[b], tok[b], cfgs[b], u[b], counts[b], TOL):
                    skipped += 1
                    continue
                n, c = sample_mtp_chain_row(vh[b], dh[b], tok[b], cfgs[b], u[b], counts[b])
                compared += 1
                ns.append(n)
                assert list(out[b]) == expected_bundle(n, c, int(tok[b, 0]), K, V), (K, V, b, cfgs[b])
    assert skipped <= 0.05 * (compared + skipped), (skipped, compared)
    assert 0 in ns and max(ns) >= 2


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sample_tokens_with_bias_equals_float64_reference(rng, dtype):
    compared = 0
    for V, B in ((int(rng.integers(2, 50)), 16), (int(rng.integers(1000, 5000)), 8), (int(rng.integers(20000, 30000)), 3)):
        lg = random_logits(rng, (B, V), DTYPES[dtype])
        hx = host(lg)
        counts = random_counts(rng, B, V)
        cfgs = [
            with_bias(SamplerConfig(temperature=float(rng.choice([0.0, 0.7, 1.3])), top_k=int(rng.choice([0, 5, 50])),
                                    top_p=float(rng.choice([1.0, 0.9])), presence_penalty=float(rng.choice([0.0, 0.5]))),
                      random_bias(rng, V))
            for _ in range(B)
        ]
        u = rng.random(B).astype(np.float32)
        out = _run(sample_tokens, lg, mx.array(u), cfgs, token_counts=mx.array(counts), logit_bias=bias_arrays(cfgs))
        for b in range(B):
            if not np.isfinite(hx[b]).any() or np.isnan(hx[b]).any() or np.isposinf(hx[b]).any():
                assert out[b] == -1
                continue
            if kept_ambiguous(hx[b], cfgs[b], counts[b]):
                continue
            p = transform_row(hx[b], cfgs[b], counts[b]).p
            if cdf_ambiguous(p, float(u[b])):
                continue
            assert out[b] == sample_from(p, float(u[b])), (V, b, cfgs[b])
            compared += 1
    assert compared >= 20


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_chain_argmax_is_that_of_the_biased_logits(rng, dtype):
    for K in (1, 3, 8):
        for V in (int(rng.integers(2, 60)), int(rng.integers(20000, 30000))):
            B = int(rng.integers(2, 9))
            lg, hx, tok = greedy_case(rng, B, K, V, DTYPES[dtype])
            biases = [random_bias(rng, V) for _ in range(B)]
            # Drafts that follow the biased argmax for a while, so deep chains happen.
            for b in range(B):
                bl = biased_logits(hx[b], sorted(biases[b].items()))
                depth = rng.integers(0, K + 1)
                for i in range(1, depth + 1):
                    if np.isfinite(bl[i - 1]).any() and not np.isnan(bl[i - 1]).any():
                        tok[b, i] = int(np.argmax(bl[i - 1]))
            cfgs = [SamplerConfig(temperature=0.0, logit_bias=bb) for bb in biases]
            out = _run(verify_greedy_chain, lg, mx.array(tok), logit_bias=bias_arrays(cfgs))
            for b in range(B):
                n, c = greedy_chain_row(biased_logits(hx[b], cfgs[b].logit_bias), tok[b])
                assert list(out[b]) == expected_bundle(n, c, int(tok[b, 0]), K, V), (K, V, b, biases[b])


def test_large_biases_force_and_ban_tokens_in_every_kernel(rng):
    B, K, V = 6, 3, 5000
    lg = mx.array(rng.normal(size=(B, K + 1, V)).astype(np.float32) * 3)
    forced = rng.integers(V, size=B)
    top = np.argmax(np.array(lg), axis=-1)  # [B, K + 1]
    force = [SamplerConfig(temperature=1.0, logit_bias={int(forced[b]): 100.0}) for b in range(B)]
    ban = [SamplerConfig(temperature=0.0, logit_bias={int(t): -100.0 for t in set(top[b].tolist())}) for b in range(B)]
    u = mx.array(rng.random((B, K + 2)).astype(np.float32))
    tok = mx.array(np.concatenate([forced[:, None]] * (K + 1), axis=1))
    sampled = _run(verify_sampled_chain, lg, lg[:, :K], tok, u, force, logit_bias=bias_arrays(force))
    assert (sampled[:, 1] == K).all() and (sampled[:, 2:] == forced[:, None]).all()
    drawn = _run(sample_tokens, lg[:, 0], u[:, 0], force, logit_bias=bias_arrays(force))
    assert (drawn == forced).all()
    # Drafts = the unbiased argmax of each row: all accepted without the
    # bias, the first rejected (and a token outside the banned set) with it.
    drafts = mx.array(np.concatenate([forced[:, None], top[:, :K]], axis=1))
    plain = _run(verify_greedy_chain, lg, drafts)
    assert (plain[:, 1] == K).all() and (plain[:, 2:] == top).all()
    greedy = _run(verify_greedy_chain, lg, drafts, logit_bias=bias_arrays(ban))
    assert (greedy[:, 1] == 0).all()
    assert all(greedy[b, 2] not in top[b] for b in range(B))


def test_bad_bias_arguments_raise_naming_the_argument():
    lg = mx.zeros((2, 3, 10))
    tok = mx.zeros((2, 3), mx.int32)
    ids, vals = mx.zeros((2, 4), mx.int32), mx.zeros((2, 4))
    with pytest.raises(ValueError, match="logit_bias ids"):
        verify_greedy_chain(lg, tok, logit_bias=(mx.zeros((3, 4), mx.int32), vals))
    with pytest.raises(ValueError, match="logit_bias values"):
        verify_greedy_chain(lg, tok, logit_bias=(ids, mx.zeros((2, 5))))
    with pytest.raises(TypeError, match="logit_bias ids"):
        sample_tokens(lg[:, 0], mx.zeros(2), SamplerConfig(), logit_bias=(vals, vals))
    with pytest.raises(TypeError, match="logit_bias values"):
        sample_tokens(lg[:, 0], mx.zeros(2), SamplerConfig(), logit_bias=(ids, ids))
    with pytest.raises(TypeError, match="logit_bias"):
        sample_tokens(lg[:, 0], mx.zeros(2), SamplerConfig(), logit_bias=ids)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logit_bias_ids"):
        mtplx_ext._ext.verify_greedy_chain(lg, tok, mx.zeros((2, 0), mx.int32), mx.zeros((2, 0)))
    with pytest.raises(ValueError, match="both"):
        mtplx_ext._ext.verify_greedy_chain(lg, tok, ids, None)
    # int64 ids past int32 are clipped, never wrapped into the vocabulary.
    wide = mx.array([[2**32 + 3, -1, -1, -1]] * 2, dtype=mx.int64)
    out = np.array(mtplx_ext._ext.verify_greedy_chain(lg + mx.arange(10), tok, wide, mx.full((2, 4), 100.0)))
    assert (out[:, 2] == 9).all()


@pytest.mark.parametrize(
    "SamplerConfig_field",
    [{"logit_bias": {-1: 1.0}}, {"logit_bias": {3: 101.0}}, {"logit_bias": {3: float("nan")}},
     {"logit_bias": {True: 1.0}}, {"logit_bias": {3: "1"}}, {"logit_bias": {i: 1.0 for i in range(301)}},
     {"logit_bias": 5}],
)
def test_sampler_config_rejects_bad_logit_bias_naming_the_field(SamplerConfig_field):
    with pytest.raises((TypeError, ValueError), match="SamplerConfig.logit_bias"):
        SamplerConfig(**SamplerConfig_field)


# ---------------------------------------------------------------------------
# Statistical exactness with a bias


def run_biased_chain(rng, model: Bigram, x0: int, K: int, variant: int, N: int = 40_000) -> np.ndarray:
    """Histogram of K + 1 committed-and-completed tokens; drafts drawn from the biased q."""
    V = model.target.shape[0]
    toks = np.full((N, K + 1), x0, np.int64)
    for i in range(1, K + 1):
        toks[:, i] = model.sample(rng, "q", toks[:, :i])
    u = rng.random((N, K + 2)).astype(np.float32)
    counts = None if model.counts is None else mx.array(np.tile(model.counts, (N, 1)))
    out = np.array(
        verify_sampled_chain(
            mx.array(model.target[toks]), mx.array(model.draft[toks[:, :K]]), mx.array(toks.astype(np.int32)),
            mx.array(u), model.cfg, counts, logit_bias=bias_arrays([model.cfg] * N), _variant=variant,
        )
    )
    n = out[:, 1]
    assert np.all(n >= 0)
    seq = np.concatenate([np.full((N, 1), x0), out[:, 2:]], 1).astype(np.int64)
    for j in range(1, K + 2):
        todo = np.nonzero(n + 1 < j)[0]
        if todo.size:
            seq[todo, j] = model.sample(rng, "p", seq[todo, :j])
    return np.bincount(seq[:, 1:] @ (V ** np.arange(K + 1)), minlength=V ** (K + 1))


def biased_bigram(rng) -> Bigram:
    model = Bigram(rng, penalties=True)
    # Strong enough to move mass between tokens, mild enough that every
    # branch (accept, residual, bonus) still happens.
    model.cfg = with_bias(model.cfg, {0: 2.0, 2: -1.5})
    model._cache.clear()
    return model


def test_biased_chain_commits_follow_the_biased_target():
    rng = np.random.default_rng()
    model = biased_bigram(rng)
    x0 = int(rng.integers(3))
    assert g_test_pvalue(run_biased_chain(rng, model, x0, 2, 0), model.expected(x0, 2)) > ALPHA_EXACT


@pytest.mark.parametrize("variant", [BIAS_NOT_IN_RESIDUAL, BIAS_NOT_IN_DRAFT], ids=["residual_unbiased", "q_unbiased"])
def test_broken_bias_rules_are_rejected_by_the_same_test(variant):
    rng = np.random.default_rng()
    pvalues = []
    for _ in range(3):
        model = biased_bigram(rng)
        x0 = int(rng.integers(3))
        pvalues.append(g_test_pvalue(run_biased_chain(rng, model, x0, 2, variant), model.expected(x0, 2)))
        if pvalues[-1] < ALPHA_BROKEN:
            break
    assert min(pvalues) < ALPHA_BROKEN, pvalues
