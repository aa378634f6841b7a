"""Depth-K chain verification: verify_greedy_chain and verify_sampled_chain.

Both primitives against the float64 references of mtplx_ext.sampling token
for token on fresh random inputs (rows whose decisions lie within rounding of
a boundary are skipped and counted), their K = 1 agreement with the
single-draft primitives, bad inputs, the kernel-level count and extra-token
fixes, and the Metal kernels on the threadgroup emulator.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.sampling import (
    MAX_COUNT,
    SamplerConfig,
    clamp_uniform,
    counts_with,
    greedy_chain_row,
    pack_params,
    row_is_valid,
    sample_from,
    sample_mtp_chain_row,
    transform_row,
)
from _poison import poison_allocator
from test_sampling_fused import (
    DTYPES,
    TOL,
    cdf_ambiguous,
    host,
    kept_ambiguous,
    random_config,
    random_counts,
    random_logits,
)
import _seed

KS = (1, 2, 3, 5, 8)


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


def _run(fn, *args, **kw) -> np.ndarray:
    """Evaluates a primitive after poisoning the allocator for its output."""
    out = fn(*args, **kw)
    poison_allocator(out.nbytes)
    return np.array(out)


# ---------------------------------------------------------------------------
# Greedy chain


def greedy_case(rng, B, K, V, dtype):
    """Logits with planted ties, bad rows; drafts right up to a random depth."""
    x = rng.normal(size=(B, K + 1, V)) * rng.uniform(0.5, 4.0)
    for b in range(B):
        for j in range(K + 1):
            if rng.random() < 0.3:  # exact tie of the max
                i, k = rng.choice(V, size=2, replace=V < 2)
                x[b, j, i] = x[b, j, k] = x[b, j].max() + 1.0
            if rng.random() < 0.06:
                x[b, j, rng.integers(V)] = rng.choice([np.nan, np.inf])
    lg = mx.array(x.astype(np.float32)).astype(dtype)
    hx = host(lg)
    tok = np.empty((B, K + 1), np.int64)
    tok[:, 0] = rng.integers(V, size=B)
    for b in range(B):
        depth = rng.integers(0, K + 1)  # drafts 1..depth follow the argmax
        for i in range(1, K + 1):
            right = int(np.argmax(hx[b, i - 1])) if row_is_valid(hx[b, i - 1]) else 0
            tok[b, i] = right if i <= depth else rng.choice([rng.integers(V), -1, V, 2**40])
        if rng.random() < 0.1:
            tok[b, 0] = rng.choice([-1, V])
    return lg, hx, tok


def expected_bundle(n: int, committed: list[int], x0: int, K: int, V: int) -> list[int]:
    row = [x0 if 0 <= x0 < V else -1, n] + [-1] * (K + 1)
    for j, t in enumerate(committed):
        row[2 + j] = t
    return row


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_chain_equals_float64_reference_for_every_depth(rng, dtype):
    seen_n = set()
    for K in KS:
        for V in (int(rng.integers(2, 60)), int(rng.integers(20000, 32000))):
            B = int(rng.integers(1, 9))
            lg, hx, tok = greedy_case(rng, B, K, V, DTYPES[dtype])
            t_dtype = mx.int32 if rng.random() < 0.5 and np.abs(tok).max() < 2**31 else mx.int64
            out = _run(mtplx_ext.verify_greedy_chain, lg, mx.array(tok).astype(t_dtype))
            assert out.shape == (B, K + 3) and out.dtype == np.int32
            for b in range(B):
                n, c = greedy_chain_row(hx[b], tok[b])
                seen_n.add(n)
                assert list(out[b]) == expected_bundle(n, c, int(tok[b, 0]), K, V), (K, V, b)
    assert -1 in seen_n and 0 in seen_n and max(seen_n) >= 3


@pytest.mark.parametrize("K", KS)
def test_greedy_chain_accepts_oracle_drafts_and_stops_at_the_first_wrong_one(rng, K):
    B, V = 8, 500
    x = rng.normal(size=(B, K + 1, V)).astype(np.float32)
    a = x.argmax(-1)
    tok = np.concatenate([rng.integers(V, size=(B, 1)), a[:, :K]], 1).astype(np.int32)
    out = _run(mtplx_ext.verify_greedy_chain, mx.array(x), mx.array(tok))
    assert np.all(out[:, 1] == K)
    assert np.array_equal(out[:, 2:], a)
    for j in range(1, K + 1):  # drafts wrong from position j: n = j - 1
        bad = tok.copy()
        bad[:, j] = (a[:, j - 1] + rng.integers(1, V, size=B)) % V
        # A broken row past the first mismatch is never read.
        x2 = x.copy()
        if j < K:
            x2[:, j + 1 :, 0] = np.nan
        out = _run(mtplx_ext.verify_greedy_chain, mx.array(x2), mx.array(bad))
        assert np.all(out[:, 1] == j - 1), j
        assert np.array_equal(out[:, 2 : 2 + j], a[:, :j])
        assert np.all(out[:, 2 + j :] == -1)


def test_greedy_chain_with_one_draft_agrees_with_verify_greedy(rng):
    B, V = 8, 1000
    x = rng.normal(size=(B, 2, V)).astype(np.float32)
    tok = np.stack([rng.integers(V, size=B), np.where(rng.random(B) < 0.5, x[:, 0].argmax(-1), rng.integers(V, size=B))], 1)
    tok = mx.array(tok.astype(np.int32))
    chain = _run(mtplx_ext.verify_greedy_chain, mx.array(x), tok)
    single = _run(mtplx_ext.verify_greedy, mx.array(x), tok)
    assert np.array_equal(chain[:, 1], single[:, 3])  # n == accept
    assert np.array_equal(chain[:, 2], single[:, 2])  # c_1 == second (x1)
    acc = single[:, 3] == 1
    assert np.array_equal(chain[acc, 3], single[acc, 4])  # c_2 == bonus
    assert np.all(chain[~acc, 3] == -1)


def test_greedy_chain_invalid_rows_only_where_a_needed_row_is_unusable(rng):
    B, K, V = 4, 3, 64
    x = rng.normal(size=(B, K + 1, V)).astype(np.float32)
    a = x.argmax(-1)
    tok = np.concatenate([rng.integers(V, size=(B, 1)), a[:, :K]], 1).astype(np.int32)
    x[0, 0, 5] = np.nan  # row 0 is always needed
    x[1, K, :] = -np.inf  # the bonus row of an all-accepted chain
    tok[2, 0] = V  # x0 out of range
    tok[3, 2] = -5  # rejected at 2: rows 2.. are not needed
    x[3, 2:, 1] = np.inf
    out = _run(mtplx_ext.verify_greedy_chain, mx.array(x), mx.array(tok))
    assert np.all(out[:3, 1] == -1) and np.all(out[:3, 2:] == -1)
    assert out[2, 0] == -1 and out[0, 0] == tok[0, 0]
    assert out[3, 1] == 1 and list(out[3, 2:]) == [a[3, 0], a[3, 1], -1, -1]


# ---------------------------------------------------------------------------
# Sampled chain


def chain_ambiguous(vl, dl, tok, cfg, u, counts, tol) -> bool:
    """Whether any decision of the reference chain lies within `tol` of a boundary."""
    K, V = vl.shape[0] - 1, vl.shape[1]
    x0 = int(tok[0])
    if not 0 <= x0 < V:
        return False
    for i in range(1, K + 1):
        c = counts_with(counts, V, tok[:i])
        if not row_is_valid(vl[i - 1]):
            return False
        if kept_ambiguous(vl[i - 1], cfg, c, tol):
            return True
        p = transform_row(vl[i - 1], cfg, c).p
        d = int(tok[i])
        if not (0 <= d < V and row_is_valid(dl[i - 1])):
            return cdf_ambiguous(p, u[K], tol)
        if kept_ambiguous(dl[i - 1], cfg, c, tol):
            return True
        q = transform_row(dl[i - 1], cfg, c).p
        lhs = clamp_uniform(u[i - 1]) * q[d]
        if abs(lhs - p[d]) < tol * max(lhs, p[d]):
            return True
        if lhs < p[d]:
            continue
        r = np.maximum(p - q, 0.0)
        if r.sum() > 0:
            return bool(r.sum() < tol or cdf_ambiguous(r, u[K], tol))
        return cdf_ambiguous(p, u[K], tol)
    if not row_is_valid(vl[K]):
        return False
    c = counts_with(counts, V, tok)
    return kept_ambiguous(vl[K], cfg, c, tol) or cdf_ambiguous(transform_row(vl[K], cfg, c).p, u[K + 1], tol)


def sampled_case(rng, B, K, V, dtype, penalties=True):
    """Draft rows near the target (frequent acceptance) or not; drafts drawn
    from q by the reference for most rows, arbitrary or out of range for the
    rest; a few NaN heads and broken verification rows."""
    vl = random_logits(rng, (B, K + 1, V), dtype)
    bad = rng.random(B) < 0.08  # a broken verification row somewhere
    if bad.any():
        v = host(vl)
        v[bad, rng.integers(K + 1), rng.integers(V)] = np.nan
        vl = mx.array(v.astype(np.float32)).astype(dtype)
    base = host(vl)[:, :K]
    near = rng.random((B, 1, 1)) < 0.6
    noise = rng.normal(size=(B, K, V))
    dl_np = np.where(near, np.where(np.isfinite(base), base, -np.inf) + 0.05 * noise, 2 * noise)
    for b in range(B):
        if rng.random() < 0.08:
            dl_np[b, rng.integers(K), rng.integers(V)] = np.nan
    dl = mx.array(dl_np.astype(np.float32)).astype(dtype)
    counts = random_counts(rng, B, V)
    cfgs = [random_config(rng, V) for _ in range(B)]
    if not penalties:
        cfgs = [SamplerConfig(c.temperature, c.top_k, c.top_p, c.min_p) for c in cfgs]
    vh, dh = host(vl), host(dl)
    tok = np.empty((B, K + 1), np.int64)
    tok[:, 0] = rng.integers(V, size=B)
    for b in range(B):
        for i in range(1, K + 1):
            c = counts_with(counts[b], V, [t for t in tok[b, :i] if 0 <= t < V])
            if rng.random() < 0.85 and row_is_valid(dh[b, i - 1]):
                tok[b, i] = sample_from(transform_row(dh[b, i - 1], cfgs[b], c).p, rng.random())
            else:
                tok[b, i] = rng.choice([rng.integers(V), -1, V])
        if rng.random() < 0.05:
            tok[b, 0] = rng.choice([-1, V])
    u = rng.random((B, K + 2)).astype(np.float32)
    return vl, dl, vh, dh, tok, u, counts, cfgs


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sampled_chain_equals_float64_reference_token_for_token(rng, dtype):
    compared = skipped = 0
    ns = []
    for K in KS:
        for V, B in ((int(rng.integers(3, 40)), 8), (int(rng.integers(200, 3000)), 8), (int(rng.integers(25000, 32000)), 2)):
            pen = rng.random() < 0.7
            vl, dl, vh, dh, tok, u, counts, cfgs = sampled_case(rng, B, K, V, DTYPES[dtype], pen)
            use_counts = rng.random() < 0.7
            out = _run(
                mtplx_ext.verify_sampled_chain,
                vl,
                dl,
                mx.array(tok),
                mx.array(u),
                cfgs,
                mx.array(counts) if use_counts else None,
            )
            for b in range(B):
                cb = counts[b] if use_counts else None
                if chain_ambiguous(vh[b], dh[b], tok[b], cfgs[b], u[b], cb, TOL):
                    skipped += 1
                    continue
                n, c = sample_mtp_chain_row(vh[b], dh[b], tok[b], cfgs[b], u[b], cb)
                compared += 1
                ns.append(n)
                assert list(out[b]) == expected_bundle(n, c, int(tok[b, 0]), K, V), (K, V, b, cfgs[b])
    assert skipped <= 0.03 * (compared + skipped), (skipped, compared)
    # Every kind of outcome was exercised: invalid, rejected at 1, deeper, all.
    assert -1 in ns and 0 in ns and max(ns) >= 3


def test_sampled_chain_with_one_draft_equals_verify_sampled(rng):
    for V in (7, 500, 20000):
        B = 8
        vl, dl, vh, dh, tok, u, counts, cfgs = sampled_case(rng, B, 1, V, mx.float32)
        tok[:, 1] = np.clip(tok[:, 1], 0, V - 1)  # valid inputs only
        dl = mx.where(mx.isnan(dl), 0.0, dl)
        chain = _run(mtplx_ext.verify_sampled_chain, vl, dl, mx.array(tok), mx.array(u), cfgs, mx.array(counts))
        single = _run(mtplx_ext.verify_sampled, vl, dl[:, 0], mx.array(tok), mx.array(u), cfgs, token_counts=mx.array(counts))
        valid = single[:, 3] >= 0
        assert np.array_equal(chain[valid, 1], single[valid, 3])
        assert np.array_equal(chain[valid, 2], single[valid, 2])
        acc = single[:, 3] == 1
        assert np.array_equal(chain[acc, 3], single[acc, 4])


def test_bad_draft_or_broken_head_is_rejected_and_drawn_from_the_target(rng):
    B, K, V = 6, 3, 80
    cfg = SamplerConfig(temperature=0.9, top_p=0.95, presence_penalty=0.4)
    vl = rng.normal(size=(B, K + 1, V)).astype(np.float32)
    dl = vl[:, :K].copy()  # q == p: every valid draft is accepted
    tok = np.concatenate([rng.integers(V, size=(B, 1)), vl[:, :K].argmax(-1)], 1).astype(np.int64)
    tok[0, 2] = V  # out of range at position 2
    tok[1, 1] = -3
    dl[2, 1, 7] = np.nan  # broken head at position 2
    dl[3, 0, :] = -np.inf  # no finite draft logit at position 1
    tok[4, 3] = 2**40
    u = rng.random((B, K + 2)).astype(np.float32)
    out = _run(mtplx_ext.verify_sampled_chain, mx.array(vl), mx.array(dl), mx.array(tok), mx.array(u), cfg)
    for b, stop in ((0, 2), (1, 1), (2, 2), (3, 1), (4, 3)):
        n, c = sample_mtp_chain_row(vl[b], dl[b], tok[b], cfg, u[b])
        assert n == stop - 1 and out[b, 1] == n
        p = transform_row(vl[b, n].astype(np.float64), cfg, counts_with(None, V, tok[b, :stop])).p
        assert c[-1] == sample_from(p, u[b, K])
        assert list(out[b, 2 : 3 + n]) == c
    assert out[5, 1] == K


def test_sampled_chain_invalid_only_for_bad_x0_or_a_needed_verify_row(rng):
    B, K, V = 4, 2, 50
    cfg = SamplerConfig(temperature=1.0)
    vl = rng.normal(size=(B, K + 1, V)).astype(np.float32)
    dl = vl[:, :K].copy()
    tok = np.concatenate([rng.integers(V, size=(B, 1)), vl[:, :K].argmax(-1)], 1).astype(np.int32)
    tok[0, 0] = -1
    vl[1, 1, 3] = np.nan  # needed: drafts 1 accepted
    vl[2, K, :] = np.inf  # the bonus row
    tok[3, 1] = V  # rejected at 1: rows 1.. unneeded
    vl[3, 1:, 0] = np.nan
    u = rng.random((B, K + 2)).astype(np.float32)
    out = _run(mtplx_ext.verify_sampled_chain, mx.array(vl), mx.array(dl), mx.array(tok), mx.array(u), cfg)
    assert np.all(out[:3, 1] == -1) and np.all(out[:3, 2:] == -1) and out[0, 0] == -1
    assert out[3, 1] == 0 and out[3, 2] >= 0 and np.all(out[3, 3:] == -1)


# ---------------------------------------------------------------------------
# Kernel-level input fixes: counts that must not wrap, up to 8 extra tokens.


def _presence_cfg() -> SamplerConfig:
    # Greedy with a presence penalty: a penalised token loses its top spot.
    return SamplerConfig(temperature=0.0, presence_penalty=100.0)


@pytest.mark.parametrize("count_dtype", [np.int32, np.int64])
def test_saturated_counts_stay_penalised_in_every_primitive(rng, count_dtype):
    B, V = 4, 64
    x = rng.normal(size=(B, V)).astype(np.float32)
    top = x.argmax(-1)
    second = np.argsort(-x, -1)[:, 1]
    counts = np.zeros((B, V), count_dtype)
    rows = np.arange(B)
    if count_dtype == np.int32:
        counts[rows, top] = MAX_COUNT  # plus x0 = top below: must saturate
    else:
        counts[rows, top] = np.array([2**31, 2**32, 2**40, 2**63 - 1])[:B]
    counts[0, second[0]] = -5  # negative counts act as 0
    cfg = _presence_cfg()
    extra = mx.array(top[:, None].astype(np.int32))
    got = _run(mtplx_ext.sample_tokens, mx.array(x), mx.zeros((B,)), cfg, token_counts=mx.array(counts), extra_tokens=extra)
    assert np.array_equal(got, second)
    # verify_sampled: p at the draft's position counts x0 = top.
    vl = np.stack([x, x], 1)
    tok = np.stack([top, second], 1).astype(np.int32)
    u = np.zeros((B, 3), np.float32)
    out = _run(mtplx_ext.verify_sampled, mx.array(vl), mx.array(x), mx.array(tok), mx.array(u), cfg, token_counts=mx.array(counts))
    assert np.all(out[:, 3] == 1) and np.array_equal(out[:, 2], second)
    # The chain: position 1 counts x0 = top.
    chain = _run(mtplx_ext.verify_sampled_chain, mx.array(vl), mx.array(x[:, None]), mx.array(tok), mx.zeros((B, 3)), cfg, mx.array(counts))
    assert np.all(chain[:, 1] == 1) and np.array_equal(chain[:, 2], second)
    # The reference agrees: saturated, not wrapped.
    c = counts_with(counts[1], V, [top[1]])
    assert c[top[1]] == MAX_COUNT


def test_sample_tokens_counts_up_to_eight_extra_tokens(rng):
    compared = skipped = 0
    for V in (50, 3000):
        B = 16
        logits = random_logits(rng, (B, V), mx.float32)
        extra = rng.integers(-1, V, size=(B, 8))
        extra[:, 4] = extra[:, 1]  # repeated ids count twice
        counts = random_counts(rng, B, V)
        cfgs = [random_config(rng, V) for _ in range(B)]
        u = rng.random(B).astype(np.float32)
        out = _run(
            mtplx_ext.sample_tokens,
            logits,
            mx.array(u),
            cfgs,
            token_counts=mx.array(counts),
            extra_tokens=mx.array(extra.astype(np.int32)),
        )
        lg = host(logits)
        for b in range(B):
            c = counts_with(counts[b], V, [t for t in extra[b] if t >= 0])
            if not row_is_valid(lg[b]):
                assert out[b] == -1
                continue
            p = transform_row(lg[b], cfgs[b], c).p
            if kept_ambiguous(lg[b], cfgs[b], c) or cdf_ambiguous(p, u[b]):
                skipped += 1
                continue
            compared += 1
            assert out[b] == sample_from(p, u[b]), (V, b)
    assert skipped <= 0.1 * (compared + skipped)
    # The eighth extra token is counted: greedy + presence moves off it.
    x = np.zeros((1, 10), np.float32)
    x[0, 3] = 1.0
    ex = np.array([[-1] * 7 + [3]], np.int32)
    got = _run(mtplx_ext.sample_tokens, mx.array(x), mx.zeros((1,)), _presence_cfg(), extra_tokens=mx.array(ex))
    assert got[0] != 3


# ---------------------------------------------------------------------------
# Bad arguments


def test_bad_chain_arguments_raise_naming_the_argument():
    B, K, V = 2, 3, 10
    vl, dl = mx.zeros((B, K + 1, V)), mx.zeros((B, K, V))
    tok, u = mx.zeros((B, K + 1), mx.int32), mx.zeros((B, K + 2))
    cfg = SamplerConfig()
    g = mtplx_ext.verify_greedy_chain
    s = mtplx_ext.verify_sampled_chain
    for bad_k in (0, 9):
        with pytest.raises(ValueError, match="verify_logits.*K in"):
            g(mx.zeros((B, bad_k + 1, V)), mx.zeros((B, bad_k + 1), mx.int32))
        with pytest.raises(ValueError, match="verify_logits.*K in"):
            s(mx.zeros((B, bad_k + 1, V)), dl, tok, u, cfg)
        with pytest.raises(ValueError, match="verify_logits"):
            mtplx_ext._ext.verify_greedy_chain(mx.zeros((B, bad_k + 1, V)), mx.zeros((B, bad_k + 1), mx.int32))
    with pytest.raises(ValueError, match="verify_logits"):
        g(mx.zeros((B, V)), tok)
    with pytest.raises(TypeError, match="verify_logits"):
        g(vl.astype(mx.int32), tok)
    with pytest.raises(TypeError, match="verify_logits"):
        g(np.zeros((B, K + 1, V)), tok)
    with pytest.raises(ValueError, match="tokens"):
        g(vl, mx.zeros((B, K), mx.int32))
    with pytest.raises(ValueError, match="tokens"):
        g(vl, mx.zeros((B + 1, K + 1), mx.int32))
    with pytest.raises(TypeError, match="tokens"):
        g(vl, tok.astype(mx.float32))
    with pytest.raises(ValueError, match="draft_logits"):
        s(vl, mx.zeros((B, K, V + 1)), tok, u, cfg)
    with pytest.raises(ValueError, match="draft_logits"):
        s(vl, mx.zeros((B, K + 1, V)), tok, u, cfg)
    with pytest.raises(TypeError, match="draft_logits"):
        s(vl, dl.astype(mx.bfloat16), tok, u, cfg)
    with pytest.raises(ValueError, match="tokens"):
        s(vl, dl, mx.zeros((B, K + 2), mx.int32), u, cfg)
    with pytest.raises(TypeError, match="tokens"):
        s(vl, dl, tok.astype(mx.float16), u, cfg)
    with pytest.raises(ValueError, match="uniforms"):
        s(vl, dl, tok, mx.zeros((B, K + 1)), cfg)
    with pytest.raises(TypeError, match="uniforms"):
        s(vl, dl, tok, u.astype(mx.int32), cfg)
    with pytest.raises(ValueError, match="token_counts"):
        s(vl, dl, tok, u, cfg, mx.zeros((B, V + 1), mx.int32))
    with pytest.raises(TypeError, match="token_counts"):
        s(vl, dl, tok, u, cfg, mx.zeros((B, V)))
    with pytest.raises(ValueError, match="sampler"):
        s(vl, dl, tok, u, [cfg] * (B + 1))
    # The C++ op checks too (for callers of the raw binding).
    with pytest.raises(ValueError, match="uniforms"):
        mtplx_ext._ext.verify_sampled_chain(vl, dl, tok, mx.zeros((B, K)), mx.zeros((B, 7)))
    with pytest.raises(ValueError, match="params"):
        mtplx_ext._ext.verify_sampled_chain(vl, dl, tok, u, mx.zeros((B, 6)))


# ---------------------------------------------------------------------------
# Metal kernels (metal/chain.h) on the threadgroup emulator: float32
# arithmetic, so rows within 2e-5 of a decision boundary are left out.

TOL_F32 = 2e-5


def _bits(a: mx.array) -> np.ndarray:
    return np.ascontiguousarray(np.array(a)) if a.dtype == mx.float32 else np.array(a.view(mx.uint16))


def _scalar(x: int) -> np.ndarray:
    return np.array([x], np.int32)


def _emu_sampled(emu, name, vl, dl, tok, u, cfgs, counts, threads):
    B, T, _ = vl.shape
    out = np.full((B, T + 2), -7, np.int32)
    args = [_bits(vl), _bits(dl), tok, u, pack_params(cfgs, B), counts, out, _scalar(vl.shape[2]), _scalar(1), _scalar(T - 1)]
    emu.launch(name, (B,), threads, args)
    return out


@pytest.mark.parametrize("tok_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_metal_chain_kernels_equal_cpu_primitive_and_reference_on_the_emulator(rng, emu, dtype, tok_dtype):
    compared = skipped = 0
    for K, V, threads in ((1, 37, 32), (3, 300, 64), (8, 70, 256), (5, 1500, 1024)):
        B = 4
        # Greedy chain.
        lg, hx, tok = greedy_case(rng, B, K, V, DTYPES[dtype])
        tok = np.where(np.abs(tok) < 2**31, tok, V).astype(tok_dtype)
        out = np.full((B, K + 3), -7, np.int32)
        emu.launch(f"verify_greedy_chain_{dtype}_{tok_dtype}", (B,), threads, [_bits(lg), tok, out, _scalar(V), _scalar(K)])
        cpu = _run(mtplx_ext.verify_greedy_chain, lg, mx.array(tok))
        assert np.array_equal(out, cpu), (K, V)
        for b in range(B):
            n, c = greedy_chain_row(hx[b], tok[b])
            assert list(out[b]) == expected_bundle(n, c, int(tok[b, 0]), K, V)
        # Sampled chain: about 4 % of rows lie within the tolerance of a
        # decision and are skipped; 12 rows per case keep the share of
        # skips below the bound at the end by many standard deviations (4
        # rows per case failed it about once in a few hundred runs).
        Bs = 12
        vl, dl, vh, dh, tk, u, counts, cfgs = sampled_case(rng, Bs, K, V, DTYPES[dtype])
        tk = tk.astype(tok_dtype)
        out = _emu_sampled(emu, f"verify_sampled_chain_{dtype}_{tok_dtype}", vl, dl, tk, u, cfgs, counts, threads)
        cpu = _run(mtplx_ext.verify_sampled_chain, vl, dl, mx.array(tk), mx.array(u), cfgs, mx.array(counts))
        for b in range(Bs):
            if chain_ambiguous(vh[b], dh[b], tk[b], cfgs[b], u[b], counts[b], TOL_F32):
                skipped += 1
                continue
            compared += 1
            n, c = sample_mtp_chain_row(vh[b], dh[b], tk[b], cfgs[b], u[b], counts[b])
            want = expected_bundle(n, c, int(tk[b, 0]), K, V)
            assert list(out[b]) == want and list(cpu[b]) == want, (K, V, b, cfgs[b])
    assert skipped <= 0.3 * (compared + skipped)


def test_broken_chain_kernel_with_counts_one_draft_short_is_caught(emu, rng):
    K, V, B = 3, 40, 12
    mismatches = 0
    for _ in range(3):
        vl, dl, vh, dh, tk, u, counts, _ = sampled_case(rng, B, K, V, mx.float32)
        cfgs = [SamplerConfig(temperature=0.0, presence_penalty=3.0, frequency_penalty=1.0)] * B
        # x0 at the top of p_1: only the penalty on x0 moves the greedy pick.
        tk[:, 0] = np.where(np.isnan(vh[:, 0]).any(-1), tk[:, 0], np.nan_to_num(vh[:, 0], posinf=0).argmax(-1))
        tk = tk.astype(np.int32)
        good = _emu_sampled(emu, "verify_sampled_chain_float32_int32", vl, dl, tk, u, cfgs, counts, 64)
        bad = _emu_sampled(emu, "broken/chain_counts_one_short/verify_sampled_chain_float32_int32", vl, dl, tk, u, cfgs, counts, 64)
        for b in range(B):
            n, c = sample_mtp_chain_row(vh[b], dh[b], tk[b], cfgs[b], u[b], counts[b])
            want = expected_bundle(n, c, int(tk[b, 0]), K, V)
            assert list(good[b]) == want
            mismatches += list(bad[b]) != want
    assert mismatches > 0
