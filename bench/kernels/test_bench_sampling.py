"""verify_sampled (fused) vs the host NumPy float64 path vs stock MLX ops.

One sampled MTP verification per stream: target p at the draft position, the
draft distribution q, accept / residual draw, bonus draw; V = 151936 with
top-k and top-p on (Qwen's recommended sampler: T 0.7, top-k 20, top-p 0.8)
and, as a harder case, top-p alone (the kept set can then be large).

`fused` runs with the CPU kernels' worker pool at its configured thread count
(MTPLX_CPU_THREADS, default the usable CPUs up to 8); `fused_1thread` is the
same primitive with the pool off (as MTPLX_CPU_THREADS=1). The host float64
path is NumPy on one thread.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.sampling import SamplerConfig, pack_params, sample_mtp_row_cycle
from mtplx_ext.ops import threads

V = 151936
CONFIGS = {
    "topk20_topp0.8": SamplerConfig(temperature=0.7, top_k=20, top_p=0.8),
    "topp0.95": SamplerConfig(temperature=1.0, top_p=0.95),
}


def _host_distribution(logits: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    """A fast float64 host transform (what a NumPy sampler does per row)."""
    z = logits / np.float32(cfg.temperature)
    V = z.shape[-1]
    if 0 < cfg.top_k < V:
        cand = np.argpartition(-z, cfg.top_k - 1)[: cfg.top_k]
    else:
        cand = np.arange(V)
    cand = cand[np.lexsort((cand, -z[cand]))]
    e = np.exp(z[cand] - z[cand[0]])
    if cfg.top_p < 1:
        cum = np.cumsum(e)
        m = int(np.searchsorted(cum, np.float32(cfg.top_p) * cum[-1], side="left")) + 1
        cand, e = cand[:m], e[:m]
    p = np.zeros(V)
    p[cand] = e / e.sum()
    return p


def _draw(w: np.ndarray, u: float) -> int:
    c = np.cumsum(w)
    return min(int(np.searchsorted(c, u * c[-1], side="right")), len(w) - 1)


def host_float64(vl: mx.array, dl: mx.array, tokens: np.ndarray, u: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    """Copy the logits to the host, transform in float64 and verify per row."""
    vh = np.array(vl.astype(mx.float32)).astype(np.float64)
    dh = np.array(dl.astype(mx.float32)).astype(np.float64)
    out = np.full((vh.shape[0], 5), -1, np.int32)
    for b in range(vh.shape[0]):
        x0, d = int(tokens[b, 0]), int(tokens[b, 1])
        p = _host_distribution(vh[b, 0], cfg)
        q = _host_distribution(dh[b], cfg)
        out[b, :2] = (x0, d)
        if u[b, 0] * q[d] < p[d]:
            out[b, 2:] = (d, 1, _draw(_host_distribution(vh[b, 1], cfg), u[b, 2]))
        else:
            r = np.maximum(p - q, 0)
            out[b, 2:4] = (_draw(r if r.sum() > 0 else p, u[b, 1]), 0)
    return out


def _mlx_distribution(logits: mx.array, cfg: SamplerConfig) -> mx.array:
    """The transform from stock MLX ops (top-k by threshold, top-p by sort)."""
    z = logits.astype(mx.float32) / cfg.temperature
    if 0 < cfg.top_k < z.shape[-1]:
        kth = mx.topk(z, cfg.top_k, axis=-1).min(axis=-1, keepdims=True)
        z = mx.where(z >= kth, z, -mx.inf)
    p = mx.softmax(z, axis=-1)
    if cfg.top_p < 1:
        s = mx.sort(p, axis=-1)[:, ::-1]
        cum = mx.cumsum(s, axis=-1)
        # Smallest kept probability: the first sorted value where cum >= top_p.
        cut = mx.take_along_axis(s, mx.argmax(cum >= cfg.top_p, axis=-1, keepdims=True), axis=-1)
        p = mx.where(p >= cut, p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    return p


def _mlx_draw(w: mx.array, u: mx.array) -> mx.array:
    c = mx.cumsum(w, axis=-1)
    return mx.argmax(c > u[:, None] * c[:, -1:], axis=-1).astype(mx.int32)


def composed_mlx(vl: mx.array, dl: mx.array, tokens: mx.array, u: mx.array, cfg: SamplerConfig) -> mx.array:
    """The whole verification composed from stock MLX ops on the device."""
    p = _mlx_distribution(vl[:, 0], cfg)
    q = _mlx_distribution(dl, cfg)
    d = tokens[:, 1:2]
    pd = mx.take_along_axis(p, d, axis=-1)[:, 0]
    qd = mx.take_along_axis(q, d, axis=-1)[:, 0]
    accept = u[:, 0] * qd < pd
    r = mx.maximum(p - q, 0.0)
    r = mx.where(r.sum(axis=-1, keepdims=True) > 0, r, p)
    second = mx.where(accept, d[:, 0], _mlx_draw(r, u[:, 1]))
    bonus = mx.where(accept, _mlx_draw(_mlx_distribution(vl[:, 1], cfg), u[:, 2]), -1)
    return mx.stack([tokens[:, 0], d[:, 0], second, accept.astype(mx.int32), bonus], axis=1)


# impl varies fastest: the implementations of one case run back to back.
@pytest.mark.parametrize("impl", ["fused", "fused_1thread", "composed_mlx", "host_float64"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("B", [1, 8, 32])
def test_verify_sampled_speed(record, impl, B, config):
    cfg = CONFIGS[config]
    rng = np.random.default_rng(0)
    vl = mx.array((rng.standard_normal((B, 2, V)) * 3).astype(np.float32))
    # Draft logits near the target: realistic acceptance rates.
    dl = vl[:, 0] + mx.array(rng.standard_normal((B, V)).astype(np.float32))
    params = mx.array(pack_params(cfg, B))
    x0 = mx.array(rng.integers(0, V, size=B).astype(np.int32))
    d = mtplx_ext.sample_tokens(dl, mx.array(rng.random(B).astype(np.float32)), params, extra_tokens=x0[:, None])
    tokens = mx.stack([x0, d], axis=1)
    u = mx.array(rng.random((B, 3)).astype(np.float32))
    mx.eval(vl, dl, tokens, u)
    tok_h, u_h = np.array(tokens), np.array(u)
    fused = np.array(mtplx_ext.verify_sampled(vl, dl, tokens, u, params))
    # The fused bundle must equal the float64 reference before its speed counts.
    vh = np.array(vl).astype(np.float64)
    dh = np.array(dl).astype(np.float64)
    for b in range(B):
        cyc = sample_mtp_row_cycle(vh[b], dh[b], int(tok_h[b, 0]), int(tok_h[b, 1]), cfg, u_h[b])
        assert (fused[b, 2], fused[b, 3]) == (cyc.second_token, int(cyc.accepted))
    if impl in ("fused", "fused_1thread"):
        fn = lambda: mx.eval(mtplx_ext.verify_sampled(vl, dl, tokens, u, params))  # noqa: E731
        rounds = 30
    elif impl == "composed_mlx":
        fn = lambda: mx.eval(composed_mlx(vl, dl, tokens, u, cfg))  # noqa: E731
        rounds = 10
    else:
        fn = lambda: host_float64(vl, dl, tok_h, u_h, cfg)  # noqa: E731
        rounds = 10
    previous = threads.set_cpu_threads(1 if impl == "fused_1thread" else 0)
    try:
        record("verify_sampled", f"B={B} {config}", impl, fn, rounds=rounds)
    finally:
        threads.set_cpu_threads(previous)
