"""Fused sample_tokens / verify_sampled against the float64 host reference.

Token-for-token equality on fresh random cases. A row is left out of the
comparison only when the reference itself shows that one of its decisions (a
top-p / min-p cut, an accept test, an inverse-CDF draw) lies within 1e-9 of a
boundary, where double rounding of sums may legitimately go either way; the
tests also bound how many rows that may be.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.sampling import (
    SamplerConfig,
    clamp_uniform,
    counts_with,
    pack_params,
    row_is_valid,
    sample_from,
    transform_row,
)
import _seed

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOL = 1e-9


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


def random_config(rng: np.random.Generator, V: int) -> SamplerConfig:
    return SamplerConfig(
        temperature=float(rng.choice([0.0, 0.25, 0.7, 1.0, 1.6])),
        top_k=int(rng.choice([0, 0, 1, 5, 40, V - 1, V, V + 3])),
        top_p=float(rng.choice([1.0, 0.9, rng.uniform(0.05, 1.0)])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, rng.uniform(0.0, 0.3)])),
        presence_penalty=float(rng.choice([0.0, rng.normal()])),
        frequency_penalty=float(rng.choice([0.0, rng.normal() * 0.5])),
        repetition_penalty=float(rng.choice([1.0, rng.uniform(0.7, 1.5)])),
    )


def random_logits(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> mx.array:
    x = rng.normal(size=shape) * rng.uniform(0.5, 4.0)
    flat = x.reshape(-1, shape[-1])
    V = shape[-1]
    for row in flat:
        # Planted exact ties (also at the top), and masked tokens.
        src = rng.integers(V, size=3)
        row[rng.integers(V, size=3)] = row[src]
        if rng.random() < 0.3:
            row[rng.integers(V, size=max(1, V // 10))] = -np.inf
        if rng.random() < 0.2:
            row[rng.integers(V)] = row.max()
    return mx.array(x.astype(np.float32)).astype(dtype)


def host(a: mx.array) -> np.ndarray:
    """Exact float64 copy of an mx.array of logits (any float dtype)."""
    return np.array(a.astype(mx.float32)).astype(np.float64)


def random_counts(rng: np.random.Generator, B: int, V: int) -> np.ndarray:
    return (rng.integers(0, 4, size=(B, V)) * (rng.random((B, V)) < 0.05)).astype(np.int32)


def kept_ambiguous(logits: np.ndarray, cfg: SamplerConfig, counts, tol: float = TOL) -> bool:
    t = transform_row(logits, cfg, counts)
    if cfg.greedy:
        zs = np.sort(t.z)[::-1]
        return bool(tol > TOL and zs.size > 1 and 0 < zs[0] - zs[1] <= tol * max(1.0, abs(zs[0])))
    e = t.e
    top_p = float(np.float32(cfg.top_p))
    if top_p < 1:
        cum = np.cumsum(e[: t.m_k])
        if np.any(np.abs(cum - top_p * cum[-1]) <= tol * cum[-1]):
            return True
    min_p = float(np.float32(cfg.min_p))
    if tol > TOL:
        # float32 kernels: z = l / T can merge distinct nearby values into a
        # tie; that matters where it straddles a cut of the order.
        zs = t.z[t.order]
        for cut in {t.m, t.m_k}:
            if cut < zs.size and zs[cut - 1] != zs[cut]:
                if abs(zs[cut - 1] - zs[cut]) <= tol * max(1.0, abs(zs[cut])):
                    return True
    return bool(min_p > 0 and np.any(np.abs(e - min_p) <= tol))


def cdf_ambiguous(w: np.ndarray, u: float, tol: float = TOL) -> bool:
    """Whether u * total lies within rounding of a positive token's CDF edge."""
    c = np.cumsum(w)
    edges = c[np.asarray(w) > 0]
    return bool(np.any(np.abs(edges - clamp_uniform(u) * c[-1]) <= tol * c[-1]))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sample_tokens_matches_float64_reference_token_for_token(rng, dtype):
    compared = skipped = 0
    # 16411: dense rows large enough for the CPU kernel's top-p prefilter.
    for V, B in ((7, 48), (300, 48), (4099, 48), (16411, 16)):
        logits = random_logits(rng, (B, V), DTYPES[dtype])
        counts = random_counts(rng, B, V)
        extra = rng.integers(-1, V, size=(B, 2)).astype(np.int32)
        u = rng.random(B).astype(np.float32)
        u[:3] = (0.0, np.float32(np.nextafter(np.float32(1), np.float32(0))), 0.5)
        cfgs = [random_config(rng, V) for _ in range(B)]
        out = np.array(
            mtplx_ext.sample_tokens(
                logits, mx.array(u), cfgs, token_counts=mx.array(counts), extra_tokens=mx.array(extra)
            )
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
            assert out[b] == sample_from(p, u[b]), (V, b, cfgs[b])
    assert skipped <= 0.02 * (compared + skipped)


def reference_cycle(vl, dl, x0, d, cfg, u, counts, tol: float = TOL):
    """(accepted, second, bonus, ambiguous) of one row by the float64 rules."""
    V = dl.shape[-1]
    c1 = counts_with(counts, V, [x0])
    c2 = counts_with(counts, V, [x0, d])
    tp, tq = transform_row(vl[0], cfg, c1), transform_row(dl, cfg, c1)
    amb = kept_ambiguous(vl[0], cfg, c1, tol) or kept_ambiguous(dl, cfg, c1, tol)
    p, q = tp.p, tq.p
    ua, ur, ub = (clamp_uniform(x) for x in u)
    lhs = ua * q[d]
    amb |= abs(lhs - p[d]) < tol * max(lhs, p[d])
    if lhs < p[d]:
        p1 = transform_row(vl[1], cfg, c2).p
        amb |= kept_ambiguous(vl[1], cfg, c2, tol) or cdf_ambiguous(p1, ub, tol)
        return True, d, sample_from(p1, ub), amb
    r = np.maximum(p - q, 0.0)
    if r.sum() > 0:
        amb |= r.sum() < tol or cdf_ambiguous(r, ur, tol)
        return False, sample_from(r, ur), -1, amb
    return False, sample_from(p, ur), -1, amb or cdf_ambiguous(p, ur, tol)


def draw_drafts(rng, dl_host, x0, cfgs, counts):
    """Half of the drafts drawn from q by the reference, half arbitrary ids."""
    B, V = dl_host.shape
    d = rng.integers(V, size=B)
    for b in range(B):
        if b % 2 == 0 and row_is_valid(dl_host[b]):
            q = transform_row(dl_host[b], cfgs[b], counts_with(counts[b], V, [x0[b]])).p
            d[b] = sample_from(q, rng.random())
    return d


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_verify_sampled_matches_float64_row_cycle(rng, dtype):
    compared = skipped = accepted = 0
    for V in (5, 257, 3001):
        B = 48
        vl = random_logits(rng, (B, 2, V), DTYPES[dtype])
        # Draft logits near the target for some rows (frequent acceptance),
        # unrelated for others.
        near = rng.random((B, 1)) < 0.5
        base = host(vl)[:, 0]
        noise = rng.normal(size=(B, V)) * 2
        dl_np = np.where(near, np.where(np.isfinite(base), base, -np.inf) + 0.1 * noise, noise)
        dl = mx.array(dl_np.astype(np.float32)).astype(DTYPES[dtype])
        counts = random_counts(rng, B, V)
        cfgs = [random_config(rng, V) for _ in range(B)]
        x0 = rng.integers(V, size=B)
        d = draw_drafts(rng, host(dl), x0, cfgs, counts)
        u = rng.random((B, 3)).astype(np.float32)
        tokens = mx.array(np.stack([x0, d], 1).astype(np.int32))
        out = np.array(
            mtplx_ext.verify_sampled(vl, dl, tokens, mx.array(u), cfgs, token_counts=mx.array(counts))
        )
        vh, dh = host(vl), host(dl)
        for b in range(B):
            assert out[b, 0] == x0[b] and out[b, 1] == d[b]
            if not (row_is_valid(vh[b, 0]) and row_is_valid(vh[b, 1]) and row_is_valid(dh[b])):
                assert tuple(out[b, 2:]) == (-1, -1, -1)
                continue
            acc, second, bonus, amb = reference_cycle(vh[b], dh[b], int(x0[b]), int(d[b]), cfgs[b], u[b], counts[b])
            if amb:
                skipped += 1
                continue
            compared += 1
            accepted += acc
            assert (out[b, 3], out[b, 2], out[b, 4]) == (int(acc), second, bonus), (V, b, cfgs[b])
    assert skipped <= 0.02 * (compared + skipped)
    assert 0 < accepted < compared  # both branches exercised


def _compare_sample_tokens(rng, logits, counts, extra, cfgs) -> tuple[int, int]:
    """sample_tokens vs the float64 reference on every row; (compared, skipped)."""
    B, V = logits.shape
    u = rng.random(B).astype(np.float32)
    out = np.array(
        mtplx_ext.sample_tokens(
            logits, mx.array(u), cfgs, token_counts=mx.array(counts), extra_tokens=mx.array(extra)
        )
    )
    lg = host(logits)
    compared = skipped = 0
    for b in range(B):
        c = counts_with(counts[b], V, [t for t in extra[b] if t >= 0])
        p = transform_row(lg[b], cfgs[b], c).p
        if kept_ambiguous(lg[b], cfgs[b], c) or cdf_ambiguous(p, u[b]):
            skipped += 1
            continue
        compared += 1
        assert out[b] == sample_from(p, u[b]), (V, b, cfgs[b])
    return compared, skipped


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_top_k_with_penalised_tokens_around_the_cut_matches_reference(rng, dtype):
    # The sparse top-k scan skips penalised tokens and adds them back: put
    # counts on tokens near the top so that penalties move them across the
    # top-k cut in both directions (a negative presence penalty lifts them).
    B, V = 12, 151936
    x = rng.normal(size=(B, V)) * 3
    logits = mx.array(x.astype(np.float32)).astype(DTYPES[dtype])
    counts = np.zeros((B, V), np.int32)
    order = np.argsort(-x, axis=1)
    for b in range(B):
        near_top = order[b, rng.choice(200, size=30, replace=False)]
        counts[b, near_top] = rng.integers(1, 4, size=30)
        counts[b, rng.integers(V, size=50)] += 1
    extra = np.stack([order[:, 0], rng.integers(-1, V, size=B)], 1).astype(np.int32)
    cfgs = [
        SamplerConfig(
            temperature=float(rng.choice([0.7, 1.0])),
            top_k=int(rng.choice([1, 5, 20, 100])),
            top_p=float(rng.choice([1.0, 0.8])),
            presence_penalty=float(rng.choice([-1.5, 0.0, 1.0])),
            frequency_penalty=float(rng.choice([0.0, 0.3])),
            repetition_penalty=float(rng.choice([1.0, 1.3])),
        )
        for _ in range(B)
    ]
    compared, skipped = _compare_sample_tokens(rng, logits, counts, extra, cfgs)
    assert skipped <= 1 and compared >= B - 1


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_top_k_with_many_ties_at_the_cut_matches_reference(rng, dtype):
    # Few distinct logit values: the k-th largest key has many ties (all of
    # them kept as candidates, or too many for the sparse path's buffer).
    B, V = 16, 40000
    levels = rng.integers(0, 6, size=(B, V)).astype(np.float64)
    levels[:, rng.integers(V, size=5)] = 7.0  # a few tokens above the rest
    logits = mx.array(levels.astype(np.float32)).astype(DTYPES[dtype])
    counts = random_counts(rng, B, V)
    extra = rng.integers(-1, V, size=(B, 2)).astype(np.int32)
    cfgs = [
        SamplerConfig(
            temperature=1.0,
            top_k=int(rng.choice([1, 3, 20, 300, 3000])),
            top_p=float(rng.choice([1.0, 0.9])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
        )
        for _ in range(B)
    ]
    compared, skipped = _compare_sample_tokens(rng, logits, counts, extra, cfgs)
    assert skipped <= 1 and compared >= B - 1


def _edge_inputs(rng, V=40):
    vl = rng.normal(size=(1, 2, V)).astype(np.float32)
    dl = rng.normal(size=(1, V)).astype(np.float32)
    return vl, dl


def _run_verify(vl, dl, x0, d, u, cfg=SamplerConfig()):
    tokens = mx.array(np.array([[x0, d]], np.int32))
    return np.array(
        mtplx_ext.verify_sampled(mx.array(vl), mx.array(dl), tokens, mx.array(np.array([u], np.float32)), cfg)
    )[0]


def test_draft_with_zero_draft_probability_is_accepted_when_target_allows_it(rng):
    vl, dl = _edge_inputs(rng)
    d = int(rng.integers(40))
    dl[0, d] = -np.inf  # q(d) = 0, p(d) > 0
    out = _run_verify(vl, dl, 0, d, [0.999, rng.random(), rng.random()])
    assert out[3] == 1 and out[2] == d and 0 <= out[4] < 40


def test_zero_target_probability_rejects_even_with_uniform_zero(rng):
    vl, dl = _edge_inputs(rng)
    d = int(rng.integers(40))
    vl[0, 0, d] = -np.inf  # p(d) = 0
    ur = float(rng.random())
    out = _run_verify(vl, dl, 1, d, [0.0, ur, 0.5])
    p = transform_row(vl[0, 0].astype(np.float64), SamplerConfig(), counts_with(None, 40, [1])).p
    q = transform_row(dl[0].astype(np.float64), SamplerConfig(), counts_with(None, 40, [1])).p
    assert out[3] == 0 and out[4] == -1
    assert out[2] == sample_from(np.maximum(p - q, 0), ur)


def test_zero_residual_mass_draws_from_the_target(rng):
    vl, dl = _edge_inputs(rng)
    d = int(rng.integers(40))
    vl[0, 0, d] = -np.inf
    dl[0] = vl[0, 0]  # p == q and the draft outside both supports
    for _ in range(10):
        ur = float(np.float32(rng.random()))
        out = _run_verify(vl, dl, 2, d, [0.0, ur, 0.5])
        p = transform_row(vl[0, 0].astype(np.float64), SamplerConfig(), counts_with(None, 40, [2])).p
        assert out[3] == 0 and out[2] == sample_from(p, ur)


def test_emitted_tokens_never_leave_the_kept_set_at_any_position(rng):
    B, V = 400, 200
    cfgs = [
        SamplerConfig(
            temperature=float(rng.uniform(0.5, 2.0)),
            top_k=int(rng.choice([0, 3, 20])),
            top_p=float(rng.choice([1.0, 0.3, 0.7])),
            min_p=float(rng.choice([0.0, 0.1, 0.3])),
        )
        for _ in range(B)
    ]
    params = mx.array(pack_params(cfgs, B))
    p0 = random_logits(rng, (B, V), mx.float32)
    dl = random_logits(rng, (B, V), mx.float32)
    vl = random_logits(rng, (B, 2, V), mx.float32)
    x0 = mtplx_ext.sample_tokens(p0, mx.random.uniform(shape=(B,)), params)
    d = mtplx_ext.sample_tokens(dl, mx.random.uniform(shape=(B,)), params, extra_tokens=x0[:, None])
    bundle = mtplx_ext.verify_sampled(
        vl, dl, mx.stack([x0, d], 1), mx.random.uniform(shape=(B, 3)), params
    )
    x0, d, bundle = np.array(x0), np.array(d), np.array(bundle)
    p0h, dlh, vlh = host(p0), host(dl), host(vl)
    checked = 0
    for b in range(B):
        c1 = counts_with(None, V, [x0[b]])
        rows = [(p0h[b], None), (dlh[b], c1), (vlh[b, 0], c1), (vlh[b, 1], counts_with(None, V, [x0[b], d[b]]))]
        if any(kept_ambiguous(lg, cfgs[b], c) for lg, c in rows):
            continue
        checked += 1
        kept = [set(transform_row(lg, cfgs[b], c).kept.tolist()) for lg, c in rows]
        assert x0[b] in kept[0]
        assert d[b] in kept[1]
        assert bundle[b, 2] in kept[2]
        if bundle[b, 3] == 1:
            assert bundle[b, 4] in kept[3]
    assert checked >= 0.98 * B


@pytest.mark.parametrize("V", [100, 8193, 151936])
def test_every_emitted_id_is_inside_the_vocabulary(rng, V):
    B = 4 if V > 10000 else 16
    tail = int(rng.integers(1, 50))
    lg = rng.normal(size=(B, 2, V)).astype(np.float32)
    lg[..., V - tail :] = -np.inf  # zero-probability tail
    cfg = SamplerConfig(temperature=1.0, top_k=int(rng.choice([0, 7])))
    top = np.float32(np.nextafter(np.float32(1), np.float32(0)))
    u = rng.random((B, 3)).astype(np.float32)
    u[: B // 2] = top  # push every draw to the end of its CDF
    vl, dl = mx.array(lg), mx.array(lg[:, 0])
    x0 = np.array(mtplx_ext.sample_tokens(dl, mx.array(u[:, 0]), cfg))
    assert np.all((x0 >= 0) & (x0 < V - tail))
    d = np.array(
        mtplx_ext.sample_tokens(dl, mx.array(u[:, 1]), cfg, extra_tokens=mx.array(x0[:, None]))
    )
    assert np.all((d >= 0) & (d < V - tail))
    out = np.array(mtplx_ext.verify_sampled(vl, dl, mx.array(np.stack([x0, d], 1)), mx.array(u), cfg))
    assert np.all((out[:, 2] >= 0) & (out[:, 2] < V - tail))
    assert np.all((out[:, 4] == -1) | ((out[:, 4] >= 0) & (out[:, 4] < V - tail)))
    assert np.all(out[:, 3] >= 0)


def _batch(rng, B=12, V=500):
    vl = random_logits(rng, (B, 2, V), mx.bfloat16)
    dl = random_logits(rng, (B, V), mx.bfloat16)
    counts = random_counts(rng, B, V)
    cfgs = [random_config(rng, V) for _ in range(B)]
    tokens = np.stack([rng.integers(V, size=B), rng.integers(V, size=B)], 1).astype(np.int32)
    return vl, dl, tokens, counts, cfgs


def test_same_keys_reproduce_the_same_tokens(rng):
    vl, dl, tokens, counts, cfgs = _batch(rng)
    keys = mx.stack([mx.random.key(int(s)) for s in rng.integers(2**31, size=len(cfgs))])

    def run():
        u = mtplx_ext.ops.sampled_verify.row_uniforms(keys, 4)
        x = mtplx_ext.sample_tokens(dl, u[:, 0], cfgs, token_counts=mx.array(counts))
        v = mtplx_ext.verify_sampled(vl, dl, mx.array(tokens), u[:, 1:], cfgs, token_counts=mx.array(counts))
        return np.array(x), np.array(v)

    a, b = run(), run()
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_permuting_streams_permutes_outputs_exactly(rng):
    vl, dl, tokens, counts, cfgs = _batch(rng)
    B = len(cfgs)
    keys = mx.stack([mx.random.key(int(s)) for s in rng.integers(2**31, size=B)])
    perm = rng.permutation(B)
    pm = mx.array(perm)

    def run(vl, dl, tokens, counts, cfgs, keys):
        u = mtplx_ext.ops.sampled_verify.row_uniforms(keys, 4)
        x = mtplx_ext.sample_tokens(dl, u[:, 0], cfgs, token_counts=mx.array(counts))
        v = mtplx_ext.verify_sampled(vl, dl, mx.array(tokens), u[:, 1:], cfgs, token_counts=mx.array(counts))
        return np.array(x), np.array(v)

    x, v = run(vl, dl, tokens, counts, cfgs, keys)
    xp, vp = run(vl[pm], dl[pm], tokens[perm], counts[perm], [cfgs[i] for i in perm], keys[pm])
    assert np.array_equal(xp, x[perm]) and np.array_equal(vp, v[perm])


def test_unusable_rows_get_minus_one_and_leave_other_rows_alone(rng):
    B, V = 8, 64
    lg = rng.normal(size=(B, 2, V)).astype(np.float32)
    dl = rng.normal(size=(B, V)).astype(np.float32)
    lg[0, 0, rng.integers(V)] = np.nan
    lg[1, 1, rng.integers(V)] = np.inf
    dl[2, :] = -np.inf
    tokens = rng.integers(V, size=(B, 2)).astype(np.int64)
    tokens[3, 0], tokens[4, 1] = V, -1
    tokens[5, 1] = 2**40  # must not wrap into the vocabulary
    u = rng.random((B, 3)).astype(np.float32)
    cfg = SamplerConfig(temperature=0.8, top_p=0.9)
    out = np.array(mtplx_ext.verify_sampled(mx.array(lg), mx.array(dl), mx.array(tokens), mx.array(u), cfg))
    bad = [0, 1, 3, 4, 5]
    assert np.all(out[bad, 3] == -1) and np.all(out[bad, 2] == -1)
    assert out[3, 0] == -1 and out[4, 1] == -1 and out[5, 1] == -1
    # Row 2's draft logits are unusable (a broken head): the draft is
    # rejected and the token drawn from p, never blamed on the target.
    p = transform_row(lg[2, 0].astype(np.float64), cfg, counts_with(None, V, [tokens[2, 0]])).p
    assert out[2, 3] == 0 and out[2, 4] == -1 and out[2, 2] == sample_from(p, u[2, 1])
    assert np.all(out[6:, 3] >= 0)
    # The healthy rows alone give the same result.
    alone = np.array(
        mtplx_ext.verify_sampled(mx.array(lg[6:]), mx.array(dl[6:]), mx.array(tokens[6:]), mx.array(u[6:]), cfg)
    )
    assert np.array_equal(alone, out[6:])
    x = np.array(mtplx_ext.sample_tokens(mx.array(lg[:, 0]), mx.array(u[:, 0]), cfg))
    assert x[0] == -1 and np.all(x[1:] >= 0)
    x = np.array(mtplx_ext.sample_tokens(mx.array(dl), mx.array(u[:, 0]), cfg))
    assert x[2] == -1


def test_bad_arguments_raise_naming_the_argument(rng):
    B, V = 2, 10
    lg = mx.zeros((B, V))
    u = mx.zeros((B,))
    cfg = SamplerConfig()
    with pytest.raises(ValueError, match="logits"):
        mtplx_ext.sample_tokens(mx.zeros((B, 2, V)), u, cfg)
    with pytest.raises(TypeError, match="logits"):
        mtplx_ext.sample_tokens(mx.zeros((B, V), mx.int32), u, cfg)
    with pytest.raises(ValueError, match="uniforms"):
        mtplx_ext.sample_tokens(lg, mx.zeros((B + 1,)), cfg)
    with pytest.raises(ValueError, match="token_counts"):
        mtplx_ext.sample_tokens(lg, u, cfg, token_counts=mx.zeros((B, V + 1), mx.int32))
    with pytest.raises(ValueError, match="extra_tokens"):
        mtplx_ext.sample_tokens(lg, u, cfg, extra_tokens=mx.zeros((B, 9), mx.int32))
    with pytest.raises(ValueError, match="sampler"):
        mtplx_ext.sample_tokens(lg, u, [cfg] * (B + 1))
    with pytest.raises(ValueError, match="sampler"):
        mtplx_ext.sample_tokens(lg, u, mx.zeros((B, 6)))
    vl, dl, tok, u3 = mx.zeros((B, 2, V)), mx.zeros((B, V)), mx.zeros((B, 2), mx.int32), mx.zeros((B, 3))
    with pytest.raises(ValueError, match="draft_logits"):
        mtplx_ext.verify_sampled(vl, mx.zeros((B, V + 1)), tok, u3, cfg)
    with pytest.raises(TypeError, match="draft_logits"):
        mtplx_ext.verify_sampled(vl, dl.astype(mx.float16), tok, u3, cfg)
    with pytest.raises(ValueError, match="tokens"):
        mtplx_ext.verify_sampled(vl, dl, mx.zeros((B, 3), mx.int32), u3, cfg)
    with pytest.raises(TypeError, match="tokens"):
        mtplx_ext.verify_sampled(vl, dl, mx.zeros((B, 2)), u3, cfg)
    with pytest.raises(ValueError, match="uniforms"):
        mtplx_ext.verify_sampled(vl, dl, tok, mx.zeros((B, 2)), cfg)
    # The C++ op checks too (for callers of the raw binding).
    with pytest.raises(ValueError, match="params"):
        mtplx_ext._ext.verify_sampled(vl, dl, tok, u3, mx.zeros((B, 5)))


# ---------------------------------------------------------------------------
# The Metal kernels (metal/sampling.h), run on the CPU by the test suite's
# threadgroup emulator: float32 arithmetic, so rows within 2e-5 of a decision
# boundary (or with near-tied transformed logits at a cut) are left out.

TOL_F32 = 2e-5


def _bits(a: mx.array) -> np.ndarray:
    """Raw logits as the kernels read them (float32, or 16-bit patterns)."""
    return np.ascontiguousarray(np.array(a)) if a.dtype == mx.float32 else np.array(a.view(mx.uint16))


@pytest.mark.parametrize("tok", ["int32", "int64"])
@pytest.mark.parametrize("threads", [32, 64, 256, 1024])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_metal_kernels_match_the_reference_on_the_emulator(rng, emu, dtype, threads, tok):
    compared = skipped = 0
    for V in (37, 300):
        B = 12
        cfgs = [random_config(rng, V) for _ in range(B)]
        params = pack_params(cfgs, B)
        counts = random_counts(rng, B, V)
        scalar = lambda x: np.array([x], np.int32)  # noqa: E731
        # sample_tokens with counts and one extra token.
        logits = random_logits(rng, (B, V), DTYPES[dtype])
        extra = rng.integers(-1, V, size=(B, 1)).astype(tok)
        u = rng.random(B).astype(np.float32)
        out = np.full(B, -7, np.int32)
        emu.launch(
            f"sample_tokens_{dtype}_{tok}",
            (B,),
            threads,
            [_bits(logits), u, params, counts, extra, out, scalar(V), scalar(1), scalar(1)],
        )
        lg = host(logits)
        for b in range(B):
            c = counts_with(counts[b], V, [t for t in extra[b] if t >= 0])
            if not row_is_valid(lg[b]):
                assert out[b] == -1
                continue
            p = transform_row(lg[b], cfgs[b], c).p
            if kept_ambiguous(lg[b], cfgs[b], c, TOL_F32) or cdf_ambiguous(p, u[b], TOL_F32):
                skipped += 1
                continue
            compared += 1
            assert out[b] == sample_from(p, u[b]), (V, b, cfgs[b])
        # verify_sampled, drafts half from q.
        vl = random_logits(rng, (B, 2, V), DTYPES[dtype])
        dl = random_logits(rng, (B, V), DTYPES[dtype])
        x0 = rng.integers(V, size=B)
        d = draw_drafts(rng, host(dl), x0, cfgs, counts)
        tokens = np.stack([x0, d], 1).astype(tok)
        uu = rng.random((B, 3)).astype(np.float32)
        bundle = np.full((B, 5), -7, np.int32)
        emu.launch(
            f"verify_sampled_{dtype}_{tok}",
            (B,),
            threads,
            [_bits(vl), _bits(dl), tokens, uu, params, counts, bundle, scalar(V), scalar(1)],
        )
        vh, dh = host(vl), host(dl)
        for b in range(B):
            assert tuple(bundle[b, :2]) == (x0[b], d[b])
            if not (row_is_valid(vh[b, 0]) and row_is_valid(vh[b, 1]) and row_is_valid(dh[b])):
                assert tuple(bundle[b, 2:]) == (-1, -1, -1)
                continue
            acc, second, bonus, amb = reference_cycle(
                vh[b], dh[b], int(x0[b]), int(d[b]), cfgs[b], uu[b], counts[b], TOL_F32
            )
            if amb:
                skipped += 1
                continue
            compared += 1
            assert (bundle[b, 3], bundle[b, 2], bundle[b, 4]) == (int(acc), second, bonus), (V, b, cfgs[b])
    assert skipped <= 0.25 * (compared + skipped)
