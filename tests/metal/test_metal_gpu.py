"""Each primitive on the Apple GPU (mx.gpu) equals the CPU primitive (mx.cpu).

macOS only: on a Mac with Apple silicon run `pytest -m metal`. Elsewhere the
tests skip with the reason; the Metal kernels are then covered by the
threadgroup emulator (test_metal_emulator.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
import _seed

pytestmark = [
    pytest.mark.metal,
    pytest.mark.skipif(
        not mx.metal.is_available(),
        reason="no Metal GPU in this MLX build (Linux/CPU); the Metal kernels "
        "run in the threadgroup emulator instead (test_metal_emulator.py)",
    ),
]

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


@pytest.mark.parametrize("tok_dtype", [mx.int32, mx.int64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 31, 1000, 32000, 151936])
@pytest.mark.parametrize("B", [1, 3, 33])
def test_verify_greedy_gpu_equals_cpu(rng, B, V, dtype, tok_dtype):
    x = rng.standard_normal((B, 2, V)).astype(np.float32)
    if V > 1:
        for b in range(0, B, 3):  # planted ties, bad rows
            j, k = rng.choice(V, 2, replace=False)
            x[b, 0, j] = x[b, 0, k] = x[b, 0].max() + 1
        x[B - 1, 1, rng.integers(0, V)] = np.nan if B > 1 else x[0, 1, 0]
    tokens = rng.integers(-1, V + 1, (B, 2))
    tokens[:, 1] = np.where(rng.random(B) < 0.5, x[:, 0].argmax(-1), tokens[:, 1])
    xm = mx.array(x).astype(dtype)
    tm = mx.array(tokens).astype(tok_dtype)
    gpu = mtplx_ext.verify_greedy(xm, tm, stream=mx.gpu)
    cpu = mtplx_ext.verify_greedy(xm, tm, stream=mx.cpu)
    np.testing.assert_array_equal(np.array(gpu), np.array(cpu))


def _leaves(rng, B: int, n: int) -> list[mx.array]:
    out = []
    for i in range(n):
        shape = (B, *rng.integers(1, 9, size=int(rng.integers(0, 3))))
        kind = i % 4
        if kind == 0:
            out.append(mx.array(rng.standard_normal(shape).astype(np.float32)))
        elif kind == 1:
            out.append(mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16))
        elif kind == 2:
            out.append(mx.array(rng.integers(-100, 100, shape).astype(np.int8)))
        else:
            out.append(mx.array(rng.random(shape) < 0.5))
    return out


def _bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def test_snapshot_state_gpu_equals_cpu(rng):
    leaves = _leaves(rng, 5, 19)  # more leaves than one launch takes
    gpu = mtplx_ext.snapshot_state(leaves, stream=mx.gpu)
    cpu = mtplx_ext.snapshot_state(leaves, stream=mx.cpu)
    for g, c in zip(gpu, cpu):
        assert _bytes(g) == _bytes(c)


@pytest.mark.parametrize("masked", [False, True])
def test_restore_state_gpu_equals_cpu(rng, masked):
    B = 7
    snap = _leaves(rng, B, 11)
    live = [mx.array(np.array(a)[::-1].copy()) if a.dtype != mx.bfloat16 else a * 2 for a in snap]
    mask = mx.array(rng.random(B) < 0.5) if masked else None
    gpu = mtplx_ext.restore_state(live, snap, mask, stream=mx.gpu)
    cpu = mtplx_ext.restore_state(live, snap, mask, stream=mx.cpu)
    for g, c in zip(gpu, cpu):
        assert _bytes(g) == _bytes(c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 4, 9])
def test_gated_delta_capture_gpu_equals_cpu_and_mlx_lm_kernel(rng, T, dtype):
    # mlx-lm's Metal kernel (Dk a multiple of 32) gives the last state and y.
    from mlx_lm.models.gated_delta import gated_delta_kernel
    from test_gated_delta import TOL, f64, make_inputs, within

    for B, Hk, Hv, Dk, Dv in ((2, 2, 4, 128, 128), (3, 1, 2, 64, 12), (1, 2, 2, 13, 7)):
        ins = make_inputs(rng, B, T, Hk, Hv, Dk, Dv, dtype)
        gy, gs = mtplx_ext.gated_delta_capture(*ins, stream=mx.gpu)
        cy, cs = mtplx_ext.gated_delta_capture(*ins, stream=mx.cpu)
        assert within(f64(gy), f64(cy), TOL[dtype]) and within(f64(gs), f64(cs), TOL[mx.float32])
        if Dk % 32 == 0:
            with mx.stream(mx.gpu):
                ky, ks = gated_delta_kernel(*ins)
            assert within(f64(gy), f64(ky), TOL[dtype])
            assert within(f64(gs[:, -1]), f64(ks), TOL[mx.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_logit_bias_kernels_gpu_equal_cpu(rng, dtype):
    # Greedy rows (exact on both sides) through every biased kernel; +-100 and
    # moderate biases, ids past V and padding.
    from mtplx_ext.ops.greedy_verify import verify_greedy_chain
    from mtplx_ext.ops.sampled_verify import sample_tokens, verify_sampled_chain
    from mtplx_ext.sampling import SamplerConfig, pack_logit_bias

    B, K, V = 5, 3, 32000
    lg = mx.array(rng.standard_normal((B, K + 1, V)).astype(np.float32)).astype(dtype)
    biases = [{int(t): float(rng.choice([-100.0, 2.5, 100.0])) for t in rng.integers(V + 3, size=4)} for _ in range(B)]
    cfgs = [SamplerConfig(temperature=0.0, logit_bias=b) for b in biases]
    ids, vals = (mx.array(a) for a in pack_logit_bias(cfgs))
    top = np.array(mx.argmax(lg.astype(mx.float32), axis=-1))
    tok = mx.array(np.concatenate([top[:, :1], top[:, :K]], axis=1))
    u = mx.array(rng.random((B, K + 2)).astype(np.float32))
    g = np.array(verify_greedy_chain(lg, tok, logit_bias=(ids, vals), stream=mx.gpu))
    c = np.array(verify_greedy_chain(lg, tok, logit_bias=(ids, vals), stream=mx.cpu))
    assert np.array_equal(g, c)
    g = np.array(verify_sampled_chain(lg, lg[:, :K], tok, u, cfgs, logit_bias=(ids, vals), stream=mx.gpu))
    c = np.array(verify_sampled_chain(lg, lg[:, :K], tok, u, cfgs, logit_bias=(ids, vals), stream=mx.cpu))
    assert np.array_equal(g, c)
    g = np.array(sample_tokens(lg[:, 0], u[:, 0], cfgs, logit_bias=(ids, vals), stream=mx.gpu))
    c = np.array(sample_tokens(lg[:, 0], u[:, 0], cfgs, logit_bias=(ids, vals), stream=mx.cpu))
    assert np.array_equal(g, c)
