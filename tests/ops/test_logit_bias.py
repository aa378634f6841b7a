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
    pack_params,
    sample_from,
    sample_mtp_chain_row,
    transform_row,
)
from _broken_rules import sampled_chain
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue, pooled_pvalue
from test_chain_stats import Bigram
from test_chain_verify import _run, chain_ambiguous, expected_bundle, greedy_case, sampled_case
from test_sampling_fused import DTYPES, TOL, cdf_ambiguous, kept_ambiguous, random_counts, random_logits, host
import _seed


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


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


def run_biased_chain(rng, model: Bigram, x0: int, K: int, rule: str, N: int = 40_000) -> np.ndarray:
    """Histogram of K + 1 committed-and-completed tokens; drafts drawn from the biased q (the primitive, or a
    broken `rule` of `_broken_rules`)."""
    V = model.target.shape[0]
    toks = np.full((N, K + 1), x0, np.int64)
    for i in range(1, K + 1):
        toks[:, i] = model.sample(rng, "q", toks[:, :i])
    u = rng.random((N, K + 2)).astype(np.float32)
    counts = None if model.counts is None else mx.array(np.tile(model.counts, (N, 1)))
    if rule != "exact":
        out = sampled_chain(model.target[toks], model.draft[toks[:, :K]], toks, u, model.cfg, model.counts, rule)
    else:
        out = np.array(
            verify_sampled_chain(
                mx.array(model.target[toks]), mx.array(model.draft[toks[:, :K]]), mx.array(toks.astype(np.int32)),
                mx.array(u), model.cfg, counts, logit_bias=bias_arrays([model.cfg] * N),
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
    rng = _seed.rng()
    model = biased_bigram(rng)
    x0 = int(rng.integers(3))
    assert g_test_pvalue(run_biased_chain(rng, model, x0, 2, "exact"), model.expected(x0, 2)) > ALPHA_EXACT


@pytest.mark.parametrize("rule", ["bias_not_in_residual", "bias_not_in_draft"])
def test_broken_bias_rules_are_rejected_by_the_same_test(rule):
    rng = _seed.rng()
    pvalues = []
    for _ in range(3):  # pooled: one test over three models (`pooled_pvalue`)
        model = biased_bigram(rng)
        x0 = int(rng.integers(3))
        pvalues.append(g_test_pvalue(run_biased_chain(rng, model, x0, 2, rule), model.expected(x0, 2)))
    assert pooled_pvalue(pvalues) < ALPHA_BROKEN, f"broken rule {rule} not detected: p = {pvalues}"


# ---------------------------------------------------------------------------
# The Metal kernels (metal/sampling.h, metal/chain.h) on the threadgroup
# emulator: float32 arithmetic, so sampled rows within 2e-5 of a decision
# boundary are left out; outputs start poisoned (-7).

TOL_F32 = 2e-5


def _bits(a: mx.array) -> np.ndarray:
    return np.ascontiguousarray(np.array(a)) if a.dtype == mx.float32 else np.array(a.view(mx.uint16))


def _scalar(x: int) -> np.ndarray:
    return np.array([x], np.int32)


def f32_underflow(vl, dl, tok, cfg, counts) -> bool:
    """Whether a draft's p or q (float64) is too small for float32 (a +-100 bias makes e**-400 weights).

    The Metal kernels weigh in float32, where such a weight is 0: an accept
    test between two of them can go either way.
    """
    K, V = vl.shape[0] - 1, vl.shape[1]
    if not 0 <= int(tok[0]) < V:
        return False
    for i in range(1, K + 1):
        d = int(tok[i])
        if not (0 <= d < V) or not np.isfinite(vl[i - 1]).any() or np.isnan(vl[i - 1]).any():
            return False
        if np.isnan(dl[i - 1]).any() or np.isposinf(dl[i - 1]).any():
            return False
        c = counts_with(counts, V, [int(t) for t in tok[:i] if 0 <= t < V])
        for row in (vl[i - 1], dl[i - 1]):
            w = transform_row(row, cfg, c).p[d]
            if 0 < w < 1e-30:
                return True
    return False


def dense_reference(cfgs: list[SamplerConfig], V: int) -> np.ndarray:
    """[B, V] float32 bias rows: each entry's bias at its id (ids past V add nothing)."""
    out = np.zeros((len(cfgs), V), np.float32)
    for b, c in enumerate(cfgs):
        for t, v in c.logit_bias:
            if t < V:
                out[b, t] += np.float32(v)
    return out


def dense_bias(cfgs: list[SamplerConfig], V: int) -> np.ndarray:
    """The dense rows the ops layer builds for a GPU stream (its own C++ scatter), checked against the reference."""
    ids, vals = bias_arrays(cfgs)
    out = np.array(mtplx_ext._ext._dense_logit_bias(ids, vals, V))
    assert np.array_equal(out, dense_reference(cfgs, V))
    return out


def test_dense_bias_rows_of_the_gpu_path_hold_each_entry_at_its_id(rng):
    V = 50
    cfgs = [SamplerConfig(logit_bias=random_bias(rng, V)) for _ in range(7)] + [SamplerConfig()]
    dense_bias(cfgs, V)
    # Wide ids are clipped, never wrapped into the vocabulary; -1 pads.
    ids = mx.array([[2**32 + 3, -1, 7]], dtype=mx.int64)
    out = np.array(mtplx_ext._ext._dense_logit_bias(ids, mx.array([[5.0, 9.0, -2.0]]), V))
    want = np.zeros((1, V), np.float32)
    want[0, 7] = -2.0
    assert np.array_equal(out, want)


@pytest.mark.parametrize("tok_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_metal_biased_kernels_equal_cpu_primitive_and_reference_on_the_emulator(rng, emu, dtype, tok_dtype):
    compared = skipped = 0
    for K, V, threads in ((1, 37, 32), (3, 300, 64), (5, 1500, 256)):
        B = 4
        # Greedy chain: the biased argmax is exact in float32 on both sides.
        lg, hx, tok = greedy_case(rng, B, K, V, DTYPES[dtype])
        tok = np.where(np.abs(tok) < 2**31, tok, V).astype(tok_dtype)
        cfgs = [SamplerConfig(temperature=0.0, logit_bias=random_bias(rng, V)) for _ in range(B)]
        out = np.full((B, K + 3), -7, np.int32)
        emu.launch(f"verify_greedy_chain_biased_{dtype}_{tok_dtype}", (B,), threads,
                   [_bits(lg), tok, out, _scalar(V), _scalar(K), dense_bias(cfgs, V)])
        cpu = _run(verify_greedy_chain, lg, mx.array(tok), logit_bias=bias_arrays(cfgs))
        assert np.array_equal(out, cpu), (K, V)
        for b in range(B):
            n, c = greedy_chain_row(biased_logits(hx[b], cfgs[b].logit_bias), tok[b])
            assert list(out[b]) == expected_bundle(n, c, int(tok[b, 0]), K, V)
        # Sampled chain.
        vl, dl, vh, dh, tk, u, counts, cfgs = sampled_case(rng, B, K, V, DTYPES[dtype])
        cfgs = [with_bias(c, random_bias(rng, V)) for c in cfgs]
        tk = tk.astype(tok_dtype)
        out = np.full((B, K + 3), -7, np.int32)
        emu.launch(f"verify_sampled_chain_biased_{dtype}_{tok_dtype}", (B,), threads,
                   [_bits(vl), _bits(dl), tk, u, pack_params(cfgs, B), counts, out, _scalar(V), _scalar(1),
                    _scalar(K), dense_bias(cfgs, V)])
        cpu = _run(verify_sampled_chain, vl, dl, mx.array(tk), mx.array(u), cfgs, mx.array(counts),
                   logit_bias=bias_arrays(cfgs))
        for b in range(B):
            n, c = sample_mtp_chain_row(vh[b], dh[b], tk[b], cfgs[b], u[b], counts[b])
            want = expected_bundle(n, c, int(tk[b, 0]), K, V)
            assert list(cpu[b]) == want or chain_ambiguous(vh[b], dh[b], tk[b], cfgs[b], u[b], counts[b], TOL), b
            if chain_ambiguous(vh[b], dh[b], tk[b], cfgs[b], u[b], counts[b], TOL_F32) or \
                    f32_underflow(vh[b], dh[b], tk[b], cfgs[b], counts[b]):
                skipped += 1
                continue
            compared += 1
            assert list(out[b]) == want, (K, V, b, cfgs[b])
        # sample_tokens.
        logits = random_logits(rng, (B, V), DTYPES[dtype])
        extra = rng.integers(-1, V, size=(B, 2)).astype(tok_dtype)
        cfgs = [with_bias(SamplerConfig(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 7])),
                                        presence_penalty=0.4), random_bias(rng, V)) for _ in range(B)]
        cnt = random_counts(rng, B, V)
        us = rng.random(B).astype(np.float32)
        out = np.full(B, -7, np.int32)
        emu.launch(f"sample_tokens_biased_{dtype}_{tok_dtype}", (B,), threads,
                   [_bits(logits), us, pack_params(cfgs, B), cnt, extra, out, _scalar(V), _scalar(1), _scalar(2),
                    dense_bias(cfgs, V)])
        hl = host(logits)
        for b in range(B):
            c = counts_with(cnt[b], V, [int(t) for t in extra[b] if t >= 0])
            if np.isnan(hl[b]).any() or np.isposinf(hl[b]).any() or not np.isfinite(hl[b]).any():
                assert out[b] == -1
                continue
            p = transform_row(hl[b], cfgs[b], c).p
            if kept_ambiguous(hl[b], cfgs[b], c, TOL_F32) or cdf_ambiguous(p, float(us[b]), TOL_F32):
                skipped += 1
                continue
            compared += 1
            assert out[b] == sample_from(p, float(us[b])), (V, b, cfgs[b])
    assert compared >= 20 and skipped <= 0.3 * (compared + skipped)


def test_metal_unbiased_kernel_misses_what_the_bias_forces_on_the_emulator(rng, emu):
    # The same inputs through the unbiased kernel: the +100 token is not drawn,
    # so the biased kernel's agreement above is the bias at work.
    B, V = 6, 500
    logits = mx.array(rng.normal(size=(B, V)).astype(np.float32))
    forced = rng.integers(V, size=B)
    cfgs = [SamplerConfig(temperature=1.0, logit_bias={int(forced[b]): 100.0}) for b in range(B)]
    us = rng.random(B).astype(np.float32)
    args = [_bits(logits), us, pack_params(cfgs, B), np.zeros((B, V), np.int32), np.zeros((B, 1), np.int32)]
    biased, plain = np.full(B, -7, np.int32), np.full(B, -7, np.int32)
    emu.launch("sample_tokens_biased_float32_int32", (B,), 64,
               args + [biased, _scalar(V), _scalar(0), _scalar(0), dense_bias(cfgs, V)])
    emu.launch("sample_tokens_float32_int32", (B,), 64, args + [plain, _scalar(V), _scalar(0), _scalar(0)])
    assert (biased == forced).all() and (plain != forced).any()
