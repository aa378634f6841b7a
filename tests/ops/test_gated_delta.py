"""gated_delta_capture: the gated delta rule over a [B, T] chunk with the state
after every position, against a float64 reference and mlx-lm's own
computation (its op path; its Metal kernels in test_metal_gpu.py), bad
arguments, and deliberately broken variants that the checks must reject.

Tolerance (stated once, used everywhere): with q, k L2-normalised as mlx-lm
does, |got - ref| <= TOL[dtype] * (1 + |ref|) element-wise, where TOL is a
few float32 roundings of the Dk-term dot products for float32 outputs and
one rounding to the output dtype (plus that) for float16 / bfloat16.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

import mtplx_ext
from mtplx_ext.ops.gated_delta import gated_delta_capture
from mtplx_ext.ops import threads
import _seed

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


def make_inputs(rng, B, T, Hk, Hv, Dk, Dv, dtype=mx.float32, state_dtype=mx.float32):
    """Random inputs shaped as a GatedDeltaNet layer makes them (q, k unit rows, q scaled)."""
    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = mx.array(unit((B, T, Hk, Dk)) * Dk**-0.5).astype(dtype)
    k = mx.array(unit((B, T, Hk, Dk))).astype(dtype)
    v = mx.array(rng.standard_normal((B, T, Hv, Dv))).astype(dtype)
    g = mx.array(rng.uniform(0.2, 1.0, (B, T, Hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0.0, 1.0, (B, T, Hv))).astype(dtype)
    state = mx.array(rng.standard_normal((B, Hv, Dv, Dk)) * 0.5).astype(state_dtype)
    return q, k, v, g, beta, state


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def reference(q, k, v, g, beta, state, key_head=None):
    """float64 recurrence; key_head(h, Hk, Hv) picks the key head (broken variants swap it)."""
    q, k, v, g, beta, s = map(f64, (q, k, v, g, beta, state))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    key_head = key_head or (lambda h, Hk, Hv: h // (Hv // Hk))
    y = np.zeros((B, T, Hv, Dv))
    states = np.zeros((B, T, Hv, Dv, Dk))
    s = s.copy()
    for t in range(T):
        for h in range(Hv):
            hk = key_head(h, Hk, Hv)
            kt, qt = k[:, t, hk], q[:, t, hk]  # [B, Dk]
            s[:, h] *= g[:, t, h][:, None, None]
            kv = np.einsum("bjd,bd->bj", s[:, h], kt)
            delta = (v[:, t, h] - kv) * beta[:, t, h][:, None]
            s[:, h] += delta[:, :, None] * kt[:, None, :]
            y[:, t, h] = np.einsum("bjd,bd->bj", s[:, h], qt)
        states[:, t] = s
    return y, states


def within(got: np.ndarray, ref: np.ndarray, tol: float) -> bool:
    return bool(np.all(np.abs(got - ref) <= tol * (1.0 + np.abs(ref))))


def assert_within(got, ref, tol, what):
    err = np.max(np.abs(got - ref) / (1.0 + np.abs(ref)))
    assert within(got, ref, tol), f"{what}: worst scaled error {err:.3g} > {tol}"


SHAPES = [  # (B, Hk, Hv, Dk, Dv): odd head sizes, grouped heads, a Qwen3-Next head
    (1, 1, 1, 1, 1),
    (3, 2, 4, 13, 7),
    (2, 1, 3, 33, 5),
    (2, 2, 2, 128, 9),
    (1, 1, 2, 255, 3),
]


@pytest.mark.parametrize("state_dtype", list(DTYPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_capture_equals_float64_reference_at_every_position(rng, dtype, state_dtype):
    dt, sdt = DTYPES[dtype], DTYPES[state_dtype]
    for T in range(1, 10):
        B, Hk, Hv, Dk, Dv = SHAPES[T % len(SHAPES)]
        ins = make_inputs(rng, B, T, Hk, Hv, Dk, Dv, dt, sdt)
        y, states = gated_delta_capture(*ins, stream=mx.cpu)
        assert y.dtype == dt and states.dtype == sdt
        assert y.shape == (B, T, Hv, Dv) and states.shape == (B, T, Hv, Dv, Dk)
        ry, rs = reference(*ins)
        assert_within(f64(y), ry, TOL[dt], f"y T={T}")
        assert_within(f64(states), rs, TOL[sdt], f"states T={T}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_capture_equals_mlx_lm_gated_delta_ops_for_every_prefix(rng, dtype):
    # mlx-lm's op path returns the last state only: run it on each prefix.
    dt = DTYPES[dtype]
    for T in (1, 2, 4, 9):
        B, Hk, Hv, Dk, Dv = SHAPES[(T + 1) % len(SHAPES)]
        ins = make_inputs(rng, B, T, Hk, Hv, Dk, Dv, dt)
        q, k, v, g, beta, state = ins
        y, states = gated_delta_capture(*ins, stream=mx.cpu)
        my, _ = gated_delta_ops(q, k, v, g, beta, state)
        assert_within(f64(y), f64(my), TOL[dt], f"y vs mlx-lm T={T}")
        for t in range(1, T + 1):
            _, ms = gated_delta_ops(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], state)
            assert_within(f64(states[:, t - 1]), f64(ms), TOL[mx.float32], f"state {t} vs mlx-lm")


def test_capture_equals_mlx_lm_update_with_its_own_gates(rng):
    # The routed layer computes g and beta with mlx-lm's functions; the whole
    # update (sigmoid, softplus gate) must agree too.
    from mlx_lm.models.gated_delta import compute_g, gated_delta_update

    B, T, Hk, Hv, Dk, Dv = 2, 4, 2, 4, 16, 8
    q, k, v, _, _, state = make_inputs(rng, B, T, Hk, Hv, Dk, Dv)
    a = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32))
    b = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32))
    A_log = mx.array(np.log(rng.uniform(1, 16, Hv)).astype(np.float32))
    dt_bias = mx.array(rng.standard_normal(Hv).astype(np.float32))
    y_ref, s_ref = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    y, states = gated_delta_capture(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state)
    assert_within(f64(y), f64(y_ref), TOL[mx.float32], "y")
    assert_within(f64(states[:, -1]), f64(s_ref), TOL[mx.float32], "last state")


def test_broken_variants_are_rejected_by_the_tolerance(rng):
    # The checks above must be able to fail: the state before each position
    # (a capture one step late) and a wrong key-head mapping both break them.
    B, T, Hk, Hv, Dk, Dv = 2, 5, 2, 4, 16, 6
    ins = make_inputs(rng, B, T, Hk, Hv, Dk, Dv)
    y, states = gated_delta_capture(*ins, stream=mx.cpu)
    ry, rs = reference(*ins)
    late = np.concatenate([f64(ins[5])[:, None], f64(states)[:, :-1]], axis=1)
    assert not within(late, rs, TOL[mx.float32])
    wy, ws = reference(*ins, key_head=lambda h, Hk, Hv: h % Hk)
    assert not within(f64(y), wy, TOL[mx.float32]) and not within(f64(states), ws, TOL[mx.float32])


def test_capture_reads_strided_inputs_and_broadcast_gates(rng):
    B, T, Hk, Hv, Dk, Dv = 2, 3, 1, 2, 8, 4
    q, k, v, g, beta, state = make_inputs(rng, B, T, Hk, Hv, Dk, Dv)
    qt = mx.swapaxes(mx.swapaxes(q, 1, 2), 1, 2)  # same values, a transposed view
    vt = mx.array(np.asfortranarray(np.array(v)))
    gb = mx.broadcast_to(g[:, :, :1], g.shape)
    y, states = gated_delta_capture(qt, k, vt, gb, beta, state, stream=mx.cpu)
    ry, rs = reference(q, k, v, gb, beta, state)
    assert_within(f64(y), ry, TOL[mx.float32], "y")
    assert_within(f64(states), rs, TOL[mx.float32], "states")


def test_a_large_chunk_on_the_worker_pool_equals_one_thread_bit_for_bit(rng):
    # Rows are independent jobs: the thread count must not change a bit.

    B, T, Hk, Hv, Dk, Dv = 4, 4, 2, 8, 64, 64
    ins = make_inputs(rng, B, T, Hk, Hv, Dk, Dv)
    outs = {}
    try:
        for n in (1, 4):
            threads.set_cpu_threads(n)
            before = threads.cpu_pool_jobs()
            y, states = gated_delta_capture(*ins, stream=mx.cpu)
            mx.eval(y, states)
            outs[n] = (np.array(y), np.array(states), threads.cpu_pool_jobs() - before)
    finally:
        threads.set_cpu_threads(0)
    assert outs[1][2] == 0
    np.testing.assert_array_equal(outs[1][0], outs[4][0])
    np.testing.assert_array_equal(outs[1][1], outs[4][1])
    ry, rs = reference(*ins)
    assert_within(f64(mx.array(outs[4][1])), rs, TOL[mx.float32], "states")


def bad(**over):
    rng = np.random.default_rng(0)
    ins = dict(zip(("q", "k", "v", "g", "beta", "state"), make_inputs(rng, 2, 3, 2, 4, 8, 5)))
    ins.update(over)
    return ins


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=mx.zeros((2, 3, 8))), "q must have shape"),
        (dict(q=mx.zeros((2, 3, 2, 300)), k=mx.zeros((2, 3, 2, 300))), r"Dk in \[1, 256\]"),
        (dict(k=mx.zeros((2, 3, 2, 7))), "k must have shape"),
        (dict(v=mx.zeros((2, 4, 4, 5))), "v must have shape"),
        (dict(v=mx.zeros((2, 3, 3, 5)), g=mx.zeros((2, 3, 3)), beta=mx.zeros((2, 3, 3)),
              state=mx.zeros((2, 3, 5, 8))), "multiple of"),
        (dict(g=mx.zeros((2, 3))), "g must have shape"),
        (dict(beta=mx.zeros((2, 3, 5))), "beta must have shape"),
        (dict(state=mx.zeros((2, 4, 8, 5))), "state must have shape"),
        (dict(q=mx.zeros((2, 3, 2, 8), dtype=mx.int32)), "q must be float32"),
        (dict(state=mx.zeros((2, 4, 5, 8), dtype=mx.int32)), "state must be float32"),
        (dict(g=mx.zeros((2, 3, 4), dtype=mx.int32)), "g must be float32"),
        (dict(k=mx.zeros((2, 3, 2, 8), dtype=mx.float16)), "one dtype"),
    ],
)
def test_bad_shapes_and_dtypes_are_rejected_naming_the_argument(over, match):
    with pytest.raises(ValueError, match=match):
        gated_delta_capture(**bad(**over))


def test_non_array_argument_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="beta must be an mx.array"):
        gated_delta_capture(**bad(beta=[0.5]))


def test_capture_is_exported_at_package_level():
    assert mtplx_ext.gated_delta_capture is gated_delta_capture


# ---------------------------------------------------------------------------
# The Metal kernel (metal/gated_delta.h) on the threadgroup emulator, with
# outputs poisoned (NaN / 0xFFFF) before it runs.

ROWS_PER_GROUP = 4  # kGdRowsPerGroup in metal/gated_delta_rules.h


def _raw(a: mx.array) -> np.ndarray:
    """Buffer bits as the kernel reads them (bfloat16 as uint16)."""
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def _poison(shape, dtype) -> np.ndarray:
    if dtype == mx.bfloat16:
        return np.full(shape, 0xFFFF, np.uint16)  # a NaN pattern
    return np.full(shape, np.nan, np.float16 if dtype == mx.float16 else np.float32)


def _from_raw(a: np.ndarray, dtype) -> np.ndarray:
    if dtype == mx.bfloat16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def emu_capture(emu, ins, prefix=""):
    q, k, v, g, beta, state = ins
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    y = _poison((B, T, Hv, Dv), q.dtype)
    states = _poison((B, T, Hv, Dv, Dk), state.dtype)
    name = f"{prefix}gated_delta_capture_{str(q.dtype).split('.')[-1]}_{str(state.dtype).split('.')[-1]}"
    scalars = [np.array([x], np.int32) for x in (T, Hk, Hv, Dk, Dv)]
    bufs = [_raw(q), _raw(k), _raw(v), _raw(g.astype(mx.float32)), _raw(beta.astype(mx.float32)), _raw(state), y, states]
    groups = (Dv + ROWS_PER_GROUP - 1) // ROWS_PER_GROUP
    emu.launch(name, (groups, Hv, B), 32 * ROWS_PER_GROUP, bufs + scalars)
    return _from_raw(y, q.dtype), _from_raw(states, state.dtype)


@pytest.mark.parametrize("state_dtype", list(DTYPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_metal_kernel_equals_cpu_primitive_and_reference_on_the_emulator(emu, rng, dtype, state_dtype):
    dt, sdt = DTYPES[dtype], DTYPES[state_dtype]
    for T, (B, Hk, Hv, Dk, Dv) in zip((1, 3, 9), [(1, 1, 1, 1, 1), (2, 1, 2, 33, 5), (1, 2, 2, 64, 6)]):
        ins = make_inputs(rng, B, T, Hk, Hv, Dk, Dv, dt, sdt)
        ey, es = emu_capture(emu, ins)
        cy, cs = gated_delta_capture(*ins, stream=mx.cpu)
        ry, rs = reference(*ins)
        assert_within(ey, ry, TOL[dt], f"emulated y T={T}")
        assert_within(es, rs, TOL[sdt], f"emulated states T={T}")
        assert_within(ey, f64(cy), TOL[dt], "emulated y vs CPU")
        assert_within(es, f64(cs), TOL[sdt], "emulated states vs CPU")


def test_broken_metal_kernel_storing_the_state_before_the_update_is_caught(emu, rng):
    ins = make_inputs(rng, 2, 4, 1, 2, 40, 5)
    _, rs = reference(*ins)
    _, good = emu_capture(emu, ins)
    _, bad = emu_capture(emu, ins, prefix="broken/gated_delta_stale_capture/")
    assert within(good, rs, TOL[mx.float32])
    assert not within(bad, rs, TOL[mx.float32])
