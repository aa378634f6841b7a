"""Depth-K chain verification (fused) vs the same job from stock MLX ops."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.sampling import SamplerConfig, pack_params
from mtplx_ext.ops import threads
from test_bench_sampling import _mlx_distribution, _mlx_draw

V = 32000
CFG = SamplerConfig(temperature=0.8, top_p=0.95)


def composed_greedy(logits: mx.array, tokens: mx.array) -> mx.array:
    """argmax every position, accept the matching prefix, gather the commit."""
    K = tokens.shape[1] - 1
    a = mx.argmax(logits, axis=-1).astype(mx.int32)
    hit = (tokens[:, 1:] == a[:, :K]).astype(mx.int32)
    n = mx.cumprod(hit, axis=1).sum(axis=1)
    pos = mx.arange(K + 1)[None]
    c = mx.where(pos < n[:, None], mx.concatenate([tokens[:, 1:], a[:, -1:]], 1), -1)
    c = mx.where(pos == n[:, None], mx.take_along_axis(a, n[:, None], axis=1), c)
    return mx.concatenate([tokens[:, :1], n[:, None].astype(mx.int32), c], axis=1)


def composed_sampled(vl: mx.array, dl: mx.array, tokens: mx.array, u: mx.array, cfg: SamplerConfig) -> mx.array:
    """Every position's p, q, accept test and residual draw, then the prefix (no penalties)."""
    B, T, Vv = vl.shape
    K = T - 1
    p = _mlx_distribution(vl.reshape(B * T, Vv), cfg).reshape(B, T, Vv)
    q = _mlx_distribution(dl.reshape(B * K, Vv), cfg).reshape(B, K, Vv)
    d = tokens[:, 1:, None]
    pd = mx.take_along_axis(p[:, :K], d, axis=-1)[..., 0]
    qd = mx.take_along_axis(q, d, axis=-1)[..., 0]
    acc = (u[:, :K] * qd < pd).astype(mx.int32)
    n = mx.cumprod(acc, axis=1).sum(axis=1)
    r = mx.maximum(p[:, :K] - q, 0.0)
    r = mx.where(r.sum(axis=-1, keepdims=True) > 0, r, p[:, :K])
    ur = mx.repeat(u[:, K : K + 1], K, axis=1).reshape(-1)
    resid = _mlx_draw(r.reshape(B * K, Vv), ur).reshape(B, K)
    bonus = _mlx_draw(p[:, K], u[:, K + 1])
    last = mx.concatenate([resid, bonus[:, None]], axis=1)
    pos = mx.arange(K + 1)[None]
    c = mx.where(pos < n[:, None], mx.concatenate([tokens[:, 1:], bonus[:, None]], 1), -1)
    c = mx.where(pos == n[:, None], mx.take_along_axis(last, n[:, None], axis=1), c)
    return mx.concatenate([tokens[:, :1], n[:, None].astype(mx.int32), c], axis=1)


def _case(B: int, K: int, near: float):
    rng = np.random.default_rng(0)
    vl = mx.array((rng.standard_normal((B, K + 1, V)) * 3).astype(np.float32))
    dl = vl[:, :K] + near * mx.array(rng.standard_normal((B, K, V)).astype(np.float32))
    a = mx.argmax(dl, axis=-1).astype(mx.int32)  # drafts the target mostly agrees with
    tokens = mx.concatenate([mx.array(rng.integers(0, V, size=(B, 1)).astype(np.int32)), a], axis=1)
    u = mx.array(rng.random((B, K + 2)).astype(np.float32))
    mx.eval(vl, dl, tokens, u)
    return vl, dl, tokens, u


@pytest.mark.parametrize("impl", ["fused", "composed_mlx"])
@pytest.mark.parametrize("K", [3, 8])
@pytest.mark.parametrize("B", [1, 8])
def test_verify_greedy_chain_speed(record, impl, B, K):
    vl, _, tokens, _ = _case(B, K, 0.0)
    np.testing.assert_array_equal(
        np.array(mtplx_ext.verify_greedy_chain(vl, tokens)), np.array(composed_greedy(vl, tokens))
    )
    if impl == "fused":
        fn = lambda: mx.eval(mtplx_ext.verify_greedy_chain(vl, tokens))  # noqa: E731
    else:
        fn = lambda: mx.eval(composed_greedy(vl, tokens))  # noqa: E731
    record("verify_greedy_chain", f"B={B} K={K} V={V}", impl, fn)


@pytest.mark.parametrize("impl", ["fused", "fused_1thread", "composed_mlx"])
@pytest.mark.parametrize("K", [3, 8])
@pytest.mark.parametrize("B", [1, 8])
def test_verify_sampled_chain_speed(record, impl, B, K):
    vl, dl, tokens, u = _case(B, K, 0.3)
    params = mx.array(pack_params(CFG, B))
    fused = np.array(mtplx_ext.verify_sampled_chain(vl, dl, tokens, u, params))
    assert np.all(fused[:, 1] >= 0)
    if impl == "composed_mlx":
        fn = lambda: mx.eval(composed_sampled(vl, dl, tokens, u, CFG))  # noqa: E731
        rounds = 10
    else:
        fn = lambda: mx.eval(mtplx_ext.verify_sampled_chain(vl, dl, tokens, u, params))  # noqa: E731
        rounds = 30
    previous = threads.set_cpu_threads(1 if impl == "fused_1thread" else 0)
    try:
        record("verify_sampled_chain", f"B={B} K={K} V={V} top_p", impl, fn, rounds=rounds)
    finally:
        threads.set_cpu_threads(previous)
