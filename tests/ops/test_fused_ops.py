"""Fused CPU rms_norm / rope / attention / swiglu against float64 references,
mx.fast and mlx-lm.

Every comparison uses fresh random inputs (the seed is printed). The float64
references are written here from the formulas; inputs are first rounded to
the tested dtype, so the reference sees exactly what the kernel sees.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import mtplx_ext
from mtplx_ext.models import fused_modules, mlx_lm_patches
from mtplx_ext.models.base import ZeroCentredRMSNorm
from _attention import sdpa_ref
from _poison import poison_allocator
import _seed

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
#: Unit roundoff of each dtype's storage.
UNIT = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: Top-2 gap (nats) below which a fused/unfused greedy argmax flip is a tie.
TIE_TOL = 1e-4


@pytest.fixture
def rng() -> np.random.Generator:
    seed = _seed.fresh()
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def to_mx(a: np.ndarray, dtype) -> mx.array:
    out = mx.array(a.astype(np.float32)).astype(dtype)
    mx.eval(out)
    return out


def np64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def assert_close(
    got: mx.array, ref: np.ndarray, dtype: str, ulps: float, what: str, atol: float = 0.0
) -> None:
    """|got - ref| <= ulps units of the dtype's roundoff relative to the row's
    largest magnitude, plus atol; NaN exactly where the reference has NaN."""
    g = np64(got)
    assert g.shape == ref.shape, what
    assert np.array_equal(np.isnan(g), np.isnan(ref)), f"{what}: NaN pattern differs"
    ok = ~np.isnan(ref)
    r = np.abs(np.where(ok, ref, 0))
    scale = np.maximum(r.max(axis=-1, keepdims=True), 1e-3)
    tol = ulps * UNIT[dtype] * scale + atol + 1e-30
    err = np.abs(np.where(ok, g - ref, 0))
    worst = float(np.max(err / tol)) if err.size else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the tolerance of {ulps} ulps"


def strided(a: mx.array, kind: str) -> mx.array:
    """The same values as `a`, laid out as `kind` (a non-contiguous view)."""
    if kind == "contiguous":
        return a
    if kind == "transposed":
        # Stored with its two leading axes swapped, read back transposed.
        perm = [1, 0, *range(2, a.ndim)]
        out = mx.contiguous(a.transpose(perm)).transpose(perm)
    elif kind == "sliced":
        # Every other element of a twice-as-long buffer, last axis included.
        out = mx.repeat(a, 2, axis=-1)[..., ::2]
    else:
        raise ValueError(kind)
    mx.eval(out)
    return out


# ---------------------------------------------------------------------------
# References


def rms_ref(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def rope_angles(T: int, dims: int, base: float, scale: float, offsets: np.ndarray) -> np.ndarray:
    """[B, T, dims / 2] angles (offset + t) * scale * base ** (-i / (dims / 2))."""
    h = dims // 2
    inv = np.float64(base) ** (-np.arange(h) / h)
    pos = (np.arange(T)[None, :] + offsets.astype(np.float64)[:, None]) * scale
    return pos[..., None] * inv


def rope_angle_atol(x: np.ndarray, theta: np.ndarray) -> float:
    """Error bound from float32 angles (as mx.fast computes them): a few
    float32 ulps of the largest angle, times the largest input."""
    return 4 * UNIT["float32"] * float(np.abs(theta).max()) * float(np.abs(x).max())


def rope_ref(
    x: np.ndarray, dims: int, traditional: bool, base: float, scale: float, offsets: np.ndarray
) -> np.ndarray:
    """offsets: [B] start positions."""
    B, T = x.shape[0], x.shape[-2]
    h = dims // 2
    theta = rope_angles(T, dims, base, scale, offsets)
    shape = (B,) + (1,) * (x.ndim - 3) + (T, h)
    c, s = np.cos(theta).reshape(shape), np.sin(theta).reshape(shape)
    out = x.copy()
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = x1 * c - x2 * s
        out[..., 1:dims:2] = x1 * s + x2 * c
    else:
        x1, x2 = x[..., :h], x[..., h:dims]
        out[..., :h] = x1 * c - x2 * s
        out[..., h:dims] = x1 * s + x2 * c
    return out


def lowest_of(dtype: str) -> float:
    return float(mx.finfo(DTYPES[dtype]).min)


# ---------------------------------------------------------------------------
# rms_norm


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_rms_norm_matches_float64_reference_and_mx_fast(rng, dtype, layout):
    dt = DTYPES[dtype]
    for shape in [(1, 1, 192), (3, 5, 64), (2, 3, 4, 33), (7, 1)]:
        x = strided(to_mx(rng.standard_normal(shape) * rng.uniform(0.1, 10), dt), layout)
        w = to_mx(rng.standard_normal(shape[-1]), dt)
        eps = float(rng.choice([1e-6, 1e-5, 0.1]))
        for weight in (w, None):
            got = mtplx_ext.rms_norm(x, weight, eps)
            assert got.dtype == dt and tuple(got.shape) == shape
            ref = rms_ref(np64(x), None if weight is None else np64(weight), eps)
            # Two roundings to the dtype (before and after the weight), as
            # mx.fast; in float32 the sum of squares' rounding dominates.
            ulps = 16 if dtype == "float32" else 2.5
            assert_close(got, ref, dtype, ulps, f"rms_norm {shape} vs float64")
            fast = mx.fast.rms_norm(x, weight, eps)
            assert_close(got, np64(fast), dtype, ulps, f"rms_norm {shape} vs mx.fast")


def test_rms_norm_of_mixed_dtypes_promotes_like_mx_fast(rng):
    x = to_mx(rng.standard_normal((2, 16)), mx.float16)
    w = to_mx(rng.standard_normal(16), mx.float32)
    got = mtplx_ext.rms_norm(x, w, 1e-5)
    fast = mx.fast.rms_norm(x, w, 1e-5)
    assert got.dtype == fast.dtype == mx.float32
    assert_close(got, np64(fast), "float32", 4, "mixed dtypes")


# ---------------------------------------------------------------------------
# rope


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("traditional", [False, True])
def test_rope_matches_float64_reference_and_mx_fast(rng, dtype, traditional):
    dt = DTYPES[dtype]
    cases = [
        # shape, dims, offset kind, layout
        ((2, 4, 7, 64), 64, "int", "contiguous"),
        ((3, 2, 1, 64), 32, "per_batch", "transposed"),
        ((2, 5, 64), 48, "scalar_array", "contiguous"),
        ((2, 2, 3, 2, 16), 16, "per_batch", "sliced"),
        ((1, 3, 2, 128), 128, "int", "transposed"),
    ]
    for shape, dims, off_kind, layout in cases:
        B = shape[0]
        x = strided(to_mx(rng.standard_normal(shape), dt), layout)
        base = float(rng.choice([10000.0, 1e6, 500.0]))
        scale = float(rng.choice([1.0, 0.25]))
        if off_kind == "int":
            offset = int(rng.integers(0, 5000))
            offsets = np.full(B, offset)
        elif off_kind == "scalar_array":
            offsets = np.full(B, int(rng.integers(0, 5000)))
            offset = mx.array(int(offsets[0]))
        else:  # left-padded batch: negative starts are possible
            offsets = rng.integers(-8, 3000, size=B)
            offset = mx.array(offsets, dtype=mx.int32)
        got = mtplx_ext.rope(
            x, dims, traditional=traditional, base=base, scale=scale, offset=offset
        )
        assert got.dtype == dt and tuple(got.shape) == shape
        x64 = np64(x)
        ref = rope_ref(x64, dims, traditional, base, scale, offsets)
        atol = rope_angle_atol(x64, rope_angles(shape[-2], dims, base, scale, offsets))
        what = f"rope {shape} dims {dims} {off_kind} {layout}"
        ulps = 8 if dtype == "float32" else 1
        assert_close(got, ref, dtype, ulps, what + " vs float64", atol)
        fast = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
        # mx.fast also rounds cos, sin and each product to the dtype.
        ulps = 8 if dtype == "float32" else 4
        assert_close(got, np64(fast), dtype, ulps, what + " vs mx.fast", 2 * atol)


def test_rope_accepts_int64_offsets_and_passes_features_beyond_dims_unchanged(rng):
    x = to_mx(rng.standard_normal((2, 3, 4, 64)), mx.bfloat16)
    off = mx.array([5, 9], dtype=mx.int64)
    got = mtplx_ext.rope(x, 16, traditional=False, base=10000.0, scale=1.0, offset=off)
    assert mx.array_equal(got[..., 16:], x[..., 16:]).item()
    fast = mx.fast.rope(x, 16, traditional=False, base=10000.0, scale=1.0, offset=off)
    assert_close(got, np64(fast), "bfloat16", 4, "int64 offsets")


# ---------------------------------------------------------------------------
# attention

MASK_KINDS = ["none", "causal", "bool", "additive"]


def make_mask(rng, kind: str, B: int, Hq: int, T: int, S: int, dt):
    """(mask for the ops, mask for the reference)."""
    if kind == "none":
        return None, None
    if kind == "causal":
        return "causal", "causal"
    shape = [(B, Hq, T, S), (B, 1, T, S), (T, S), (1, Hq, 1, S)][int(rng.integers(4))]
    keep = rng.random(shape) < 0.7
    if kind == "bool":
        return mx.array(keep), keep
    add = np.where(keep, rng.standard_normal(shape), -np.inf)
    m = to_mx(add, dt)
    return m, np64(m)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_attention_matches_float64_reference_and_mx_fast(rng, dtype, mask_kind):
    dt = DTYPES[dtype]
    for T in (1, 2, 7):
        for S in (1, 33, 300):
            B = int(rng.integers(1, 3))
            Hkv = int(rng.choice([1, 2]))
            Hq = Hkv * int(rng.choice([1, 3, 4]))
            D = int(rng.choice([64, 128, 24]))
            q = to_mx(rng.standard_normal((B, Hq, T, D)), dt)
            k = to_mx(rng.standard_normal((B, Hkv, S, D)), dt)
            v = to_mx(rng.standard_normal((B, Hkv, S, D)), dt)
            scale = float(D**-0.5 * rng.uniform(0.5, 2.0))
            mask, mask_ref = make_mask(rng, mask_kind, B, Hq, T, S, dt)
            got = mtplx_ext.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            assert got.dtype == dt and tuple(got.shape) == (B, Hq, T, D)
            ref = sdpa_ref(np64(q), np64(k), np64(v), scale, mask_ref, lowest_of(dtype))
            what = f"attention T {T} S {S} Hq {Hq} Hkv {Hkv} D {D} mask {mask_kind}"
            ulps = 64 if dtype == "float32" else 1.5
            assert_close(got, ref, dtype, ulps, what + " vs float64")
            fast = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            ulps_fast = 64 if dtype == "float32" else 16
            assert_close(got, np64(fast), dtype, ulps_fast, what + " vs mx.fast")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attention_reads_strided_queries_cache_slices_and_broadcast_masks(rng, dtype):
    """mlx-lm's layout: q transposed from [B, T, H, D], k/v the first S rows
    of a longer cache buffer, a [B, 1, T, S] bool mask."""
    dt = DTYPES[dtype]
    B, Hq, Hkv, T, S, D = 3, 4, 2, 2, 40, 64
    q = to_mx(rng.standard_normal((B, T, Hq, D)), dt).transpose(0, 2, 1, 3)
    kbuf = to_mx(rng.standard_normal((B, Hkv, 256, D)), dt)
    vbuf = to_mx(rng.standard_normal((B, Hkv, 256, D)), dt)
    k, v = kbuf[:, :, :S, :], vbuf[:, :, :S, :]
    keep = rng.random((B, 1, T, S)) < 0.8
    mask = mx.array(keep)[:, :, :, :]
    for m, mref in ((mask, keep), ("causal", "causal"), (None, None)):
        got = mtplx_ext.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
        ref = sdpa_ref(np64(q), np64(k), np64(v), 0.125, mref, lowest_of(dtype))
        assert_close(got, ref, dtype, 64 if dtype == "float32" else 1.5, f"strided {dtype}")
    # A transposed key layout (last axis not contiguous) is read correctly too.
    kt = mx.contiguous(k.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    got = mtplx_ext.scaled_dot_product_attention(q, kt, strided(v, "sliced"), scale=0.125)
    ref = sdpa_ref(np64(q), np64(k), np64(v), 0.125, None, lowest_of(dtype))
    assert_close(got, ref, dtype, 64 if dtype == "float32" else 1.5, "transposed keys")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attention_fully_masked_rows_average_values_or_are_nan_like_mx_fast(rng, dtype):
    dt = DTYPES[dtype]
    B, H, T, S, D = 1, 2, 3, 5, 16
    q = to_mx(rng.standard_normal((B, H, T, D)), dt)
    k = to_mx(rng.standard_normal((B, H, S, D)), dt)
    v = to_mx(rng.standard_normal((B, H, S, D)), dt)
    keep = rng.random((T, S)) < 0.6
    keep[:, 0] = True
    keep[1] = False  # row 1 fully masked: uniform average of v
    got = mtplx_ext.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mx.array(keep))
    mean_v = np64(v).mean(axis=2)
    assert np.allclose(np64(got)[:, :, 1], mean_v, atol=4 * UNIT[dtype] * 4)
    fast = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mx.array(keep))
    assert_close(got, np64(fast), dtype, 16, "bool fully masked row")
    # Causal with more queries than keys: the first T - S rows see nothing.
    q7 = to_mx(rng.standard_normal((B, H, 7, D)), dt)
    got = mtplx_ext.scaled_dot_product_attention(q7, k, v, scale=0.3, mask="causal")
    fast = mx.fast.scaled_dot_product_attention(q7, k, v, scale=0.3, mask="causal")
    assert np.allclose(np64(got)[:, :, 0], mean_v, atol=16 * UNIT[dtype])
    assert_close(got, np64(fast), dtype, 16, "causal T > S")
    # Additive mask of all -inf on a row: NaN there only, as mx.fast.
    add = np.where(keep, 0.0, -np.inf)
    got = mtplx_ext.scaled_dot_product_attention(q, k, v, scale=0.3, mask=to_mx(add, dt))
    fast = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=to_mx(add, dt))
    g, f = np64(got), np64(fast)
    assert np.isnan(g[:, :, 1]).all() and np.isnan(f[:, :, 1]).all()
    assert np.isfinite(g[:, :, [0, 2]]).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attention_over_a_ragged_cache_skips_slots_outside_every_span_and_threads_change_no_bit(rng, dtype):
    """A fixed-capacity ragged cache: stream b sees slots [pad_b, end_b + t]
    (its own left padding and end), the slots around hold anything, here
    NaN and huge values. They get weight 0 in the fallback, so the output
    equals the float64 reference on zeroed slots; the jobs split over the
    pool give the one-thread result bit for bit."""
    from mtplx_ext.ops.threads import cpu_pool_jobs, set_cpu_threads

    dt = DTYPES[dtype]
    B, Hkv, rep, T, S, D = 4, 4, 3, 6, 384, 64
    Hq = Hkv * rep
    pads = rng.integers(0, 40, B)
    ends = rng.integers(60, S - T - 60, B)
    slot = np.arange(S)
    keep = np.stack([(slot[None, :] >= pads[b]) & (slot[None, :] <= ends[b] + np.arange(T)[:, None]) for b in range(B)])
    keep = keep[:, None]  # [B, 1, T, S], as the ragged cache builds it
    outside = ~np.any(keep[:, 0], axis=1)  # [B, S]: slots no query of the stream sees
    q = to_mx(rng.standard_normal((B, Hq, T, D)), dt)
    kn = rng.standard_normal((B, Hkv, S, D))
    vn = rng.standard_normal((B, Hkv, S, D))
    poison = np.where(rng.random((B, Hkv, S, D)) < 0.5, np.nan, 6.0e4)
    k = to_mx(np.where(outside[:, None, :, None], poison, kn), dt)
    v = to_mx(np.where(outside[:, None, :, None], poison, vn), dt)
    mask = mx.array(keep)
    outs = {}
    try:
        for n in (1, 2):
            set_cpu_threads(n)
            before = cpu_pool_jobs()
            got = mtplx_ext.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
            mx.eval(got)
            outs[n] = (np.array(got.astype(mx.float32)), cpu_pool_jobs() - before)
    finally:
        set_cpu_threads(0)
    assert outs[1][1] == 0
    np.testing.assert_array_equal(outs[1][0], outs[2][0])
    zeroed = lambda a: np.where(outside[:, None, :, None], 0.0, np64(a))  # noqa: E731
    ref = sdpa_ref(np64(q), zeroed(k), zeroed(v), 0.125, keep, lowest_of(dtype))
    assert np.isfinite(ref).all()
    assert_close(mx.array(outs[2][0]), ref, dtype, 64 if dtype == "float32" else 1.5, f"ragged {dtype}")


# ---------------------------------------------------------------------------
# swiglu


def swiglu_ref(g: np.ndarray, x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return g / (1.0 + np.exp(-g)) * x


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_swiglu_matches_float64_reference_and_mlx_lm(rng, dtype, layout):
    from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

    dt = DTYPES[dtype]
    for shape in [(1, 1, 576), (3, 5, 64), (2, 3, 4, 33), (7, 1)]:
        # Gates over the whole useful range: saturated on both sides, and near 0.
        g = strided(to_mx(rng.standard_normal(shape) * rng.choice([0.5, 4.0, 40.0]), dt), layout)
        x = strided(to_mx(rng.standard_normal(shape), dt), layout)
        got = mtplx_ext.swiglu(g, x)
        assert got.dtype == dt and tuple(got.shape) == shape
        ref = swiglu_ref(np64(g), np64(x))
        # Three roundings to the dtype in half precision, as the composed graph.
        ulps = 8 if dtype == "float32" else 3.5
        assert_close(got, ref, dtype, ulps, f"swiglu {shape} vs float64")
        # MLX's float16 sigmoid flushes values below 2^-14 to 0 (gates under
        # about -9.7); the fused op keeps them, so there mlx-lm is off by up
        # to |gate * 2^-14 * x|.
        atol = 1e-3 * float(np.abs(np64(x)).max()) if dtype == "float16" else 0.0
        assert_close(got, np64(mlx_lm_swiglu(g, x)), dtype, 2 * ulps, f"swiglu {shape} vs mlx-lm", atol)


def test_swiglu_special_values_match_mlx_lm():
    from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

    inf, nan = float("inf"), float("nan")
    g = mx.array([nan, -inf, inf, -200.0, -88.0, -20.0, 0.0, 20.0, 88.0, 200.0, 1.0, 1.0])
    x = mx.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, nan, inf])
    got, ref = np64(mtplx_ext.swiglu(g, x)), np64(mlx_lm_swiglu(g, x))
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.allclose(got[ok], ref[ok], rtol=1e-6, atol=1e-30)
    with np.errstate(over="ignore", invalid="ignore"):
        want = swiglu_ref(np64(g), np64(x))
    assert np.array_equal(np.isnan(got), np.isnan(want))


def test_swiglu_of_mixed_dtypes_promotes(rng):
    g = to_mx(rng.standard_normal((2, 16)), mx.float16)
    x = to_mx(rng.standard_normal((2, 16)), mx.float32)
    got = mtplx_ext.swiglu(g, x)
    assert got.dtype == mx.float32
    assert_close(got, swiglu_ref(np64(g), np64(x)), "float32", 8, "mixed dtypes")


# ---------------------------------------------------------------------------
# Outputs are fully written


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_outputs_are_fully_written_over_poisoned_buffers(rng, dtype):
    dt = DTYPES[dtype]
    x = to_mx(rng.standard_normal((3, 4, 5, 64)), dt)
    w = to_mx(rng.standard_normal(64), dt)
    k = to_mx(rng.standard_normal((3, 2, 9, 64)), dt)
    v = to_mx(rng.standard_normal((3, 2, 9, 24)), dt)
    off = mx.array([0, 3, 70])
    mx.eval(off)
    runs = {
        "rms_norm": (
            lambda: mtplx_ext.rms_norm(x, w, 1e-6),
            lambda: rms_ref(np64(x), np64(w), 1e-6),
            16 if dtype == "float32" else 2.5,
        ),
        "rope": (
            lambda: mtplx_ext.rope(x, 32, traditional=False, base=1e4, scale=1.0, offset=off),
            lambda: rope_ref(np64(x), 32, False, 1e4, 1.0, np.array([0, 3, 70])),
            8 if dtype == "float32" else 1.5,
        ),
        "attention": (
            lambda: mtplx_ext.scaled_dot_product_attention(x, k, v, scale=0.125, mask="causal"),
            lambda: sdpa_ref(np64(x), np64(k), np64(v), 0.125, "causal", lowest_of(dtype)),
            64 if dtype == "float32" else 1.5,
        ),
        "swiglu": (
            lambda: mtplx_ext.swiglu(x, x[:, ::-1]),
            lambda: swiglu_ref(np64(x), np64(x[:, ::-1])),
            8 if dtype == "float32" else 3.5,
        ),
    }
    atols = {"rope": rope_angle_atol(np64(x), rope_angles(5, 32, 1e4, 1.0, np.array([0, 3, 70])))}
    for name, (run, ref, ulps) in runs.items():
        out = run()
        poison_allocator(out.nbytes)
        mx.eval(out)
        assert_close(out, ref(), dtype, ulps, f"{name} over a poisoned buffer", atols.get(name, 0.0))


# ---------------------------------------------------------------------------
# Gradients


def test_vjp_and_jvp_agree_with_mx_fast(rng):
    x = to_mx(rng.standard_normal((2, 3, 4, 32)), mx.float32)
    w = to_mx(rng.standard_normal(32), mx.float32)
    q = to_mx(rng.standard_normal((2, 4, 3, 32)), mx.float32)
    k = to_mx(rng.standard_normal((2, 2, 6, 32)), mx.float32)
    v = to_mx(rng.standard_normal((2, 2, 6, 32)), mx.float32)
    add = to_mx(rng.standard_normal((3, 6)), mx.float32)
    off = mx.array([2, 11])
    pairs = {
        "rms_norm": (
            lambda a, b: mtplx_ext.rms_norm(a, b, 1e-5),
            lambda a, b: mx.fast.rms_norm(a, b, 1e-5),
            (x, w),
        ),
        "rope": (
            lambda a: mtplx_ext.rope(a, 16, traditional=True, base=1e4, scale=0.5, offset=off),
            lambda a: mx.fast.rope(a, 16, traditional=True, base=1e4, scale=0.5, offset=off),
            (x,),
        ),
        "attention causal": (
            lambda a, b, c: mtplx_ext.scaled_dot_product_attention(a, b, c, scale=0.2, mask="causal"),
            lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=0.2, mask="causal"),
            (q, k, v),
        ),
        "swiglu": (
            lambda a, b: mtplx_ext.swiglu(a, b),
            lambda a, b: nn.silu(a) * b,
            (x, x[:, ::-1]),
        ),
        "attention additive": (
            lambda a, b, c, m: mtplx_ext.scaled_dot_product_attention(a, b, c, scale=0.2, mask=m),
            lambda a, b, c, m: mx.fast.scaled_dot_product_attention(a, b, c, scale=0.2, mask=m),
            (q, k, v, add),
        ),
    }
    for name, (ours, theirs, primals) in pairs.items():
        cot = to_mx(rng.standard_normal(ours(*primals).shape), mx.float32)
        _, g1 = mx.vjp(lambda *a: [ours(*a)], list(primals), [cot])
        _, g2 = mx.vjp(lambda *a: [theirs(*a)], list(primals), [cot])
        for i, (a, b) in enumerate(zip(g1, g2)):
            assert np.allclose(np64(a), np64(b), rtol=1e-4, atol=1e-5), f"{name} vjp {i}"
        tan = [to_mx(rng.standard_normal(p.shape), mx.float32) for p in primals]
        _, j1 = mx.jvp(lambda *a: [ours(*a)], list(primals), tan)
        _, j2 = mx.jvp(lambda *a: [theirs(*a)], list(primals), tan)
        assert np.allclose(np64(j1[0]), np64(j2[0]), rtol=1e-4, atol=1e-5), f"{name} jvp"
    # A module-level gradient through fused modules equals the unfused one.
    g_fused = mx.grad(lambda a: fused_modules.FusedRMSNorm(32)(a).sum())(x)
    g_plain = mx.grad(lambda a: nn.RMSNorm(32)(a).sum())(x)
    assert np.allclose(np64(g_fused), np64(g_plain), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------
# Modules and models


def test_fuse_cpu_ops_replaces_norms_and_plain_rope_keeping_state():
    class Llama3Like(nn.RoPE):  # a RoPE variant: must stay as it is
        pass

    model = nn.Module()
    norm = nn.RMSNorm(8, eps=1e-3)
    norm.weight = mx.arange(8, dtype=mx.float32)
    norm.freeze()
    model.layers = [norm, {"rope": nn.RoPE(16, traditional=True, base=500.0, scale=0.5)}]
    model.shared = norm  # the same module twice: replaced once
    model.pair = (ZeroCentredRMSNorm(4, eps=1e-4), nn.Linear(2, 2))
    model.variant = Llama3Like(8)
    assert fused_modules.fuse_cpu_ops(model) == 3
    new = model.layers[0]
    assert type(new) is fused_modules.FusedRMSNorm and model.shared is new
    assert new.eps == 1e-3 and mx.array_equal(new.weight, mx.arange(8)).item()
    assert new.trainable_parameters() == {}  # still frozen
    rope = model.layers[1]["rope"]
    assert type(rope) is fused_modules.FusedRoPE
    assert (rope.dims, rope.traditional, rope.base, rope.scale) == (16, True, 500.0, 0.5)
    assert type(model.pair[0]) is fused_modules.FusedZeroCentredRMSNorm and model.pair[0].eps == 1e-4
    assert type(model.variant) is Llama3Like
    assert fused_modules.fuse_cpu_ops(model) == 0  # already fused


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    tokens, gaps = [], []
    argmax = lambda lp: mx.argmax(lp, axis=-1)  # noqa: E731
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=n, sampler=argmax):
        top = np.sort(np.array(logprobs, dtype=np.float64))[-2:]
        tokens.append(int(tok))
        gaps.append(float(top[1] - top[0]))
    return tokens, gaps


def test_fused_qwen3_model_matches_unfused_logits_and_greedy_tokens(rng):
    seed = int(rng.integers(1 << 30))
    plain = mtplx_ext.init_random("qwen3", seed=seed)
    fast = mtplx_ext.init_random("qwen3", seed=seed)
    n_layers = len(fast.trunk.layers)
    # Per layer: 2 norms, q_norm, k_norm, rope; the final norm; the head's.
    replaced = fused_modules.fuse_cpu_ops(fast)
    assert replaced >= 5 * n_layers + 1
    head_modules = [type(m) for _, m in fast.head.named_modules()]
    assert fused_modules.FusedZeroCentredRMSNorm in head_modules  # the qwen3_next head's norms
    assert ZeroCentredRMSNorm not in head_modules and nn.RMSNorm not in head_modules
    V = plain.vocab_size
    tokens = mx.array(rng.integers(0, V, size=(2, 9)), dtype=mx.int32)
    with mlx_lm_patches.patch_mlx_lm_attention() as patch:
        assert patch.active
        # Whole-sequence forward (causal mask) and the head.
        l0, h0 = plain.forward(tokens)
        l1, h1 = fast.forward(tokens)
        assert np.allclose(np64(l1), np64(l0), atol=2e-4, rtol=1e-4)
        nxt = tokens[:, 1:]
        hl0 = plain.head_forward(h0[:, :-1], nxt)
        hl1 = fast.head_forward(h1[:, :-1], nxt)
        assert np.allclose(np64(hl1), np64(hl0), atol=2e-4, rtol=1e-4)
        # Left-padded batch cache: per-row rope offsets and bool masks.
        caches = [m.make_cache([3, 0]) for m in (plain, fast)]
        outs = [m.forward(tokens, c)[0] for m, c in zip((plain, fast), caches)]
        step = mx.array(rng.integers(0, V, size=(2, 1)), dtype=mx.int32)
        outs += [m.forward(step, c)[0] for m, c in zip((plain, fast), caches)]
        assert np.allclose(np64(outs[1][:, 3:]), np64(outs[0][:, 3:]), atol=2e-4, rtol=1e-4)
        assert np.allclose(np64(outs[3]), np64(outs[2]), atol=2e-4, rtol=1e-4)
        # Greedy generation: identical tokens, up to a genuine near tie.
        prompt = rng.integers(0, V, size=6).tolist()
        ref, gaps = _greedy(plain.trunk, prompt, 12)
        got, _ = _greedy(fast.trunk, prompt, 12)
        for j, (g, e) in enumerate(zip(got, ref)):
            if g != e:
                assert gaps[j] < TIE_TOL, f"token {j}: {g} vs {e}, gap {gaps[j]:.3g} is no tie"
                break
        else:
            assert got == ref
    assert not patch.active


def test_attention_patch_routes_mlx_lm_and_undo_restores_it():
    import mlx_lm.models.base as base
    import mlx_lm.models.qwen3 as qwen3

    original = base.scaled_dot_product_attention
    patch = mlx_lm_patches.patch_mlx_lm_attention()
    try:
        assert "mlx_lm.models.qwen3" in patch.module_names
        assert qwen3.scaled_dot_product_attention is base.scaled_dot_product_attention
        assert base.scaled_dot_product_attention is not original
        again = mlx_lm_patches.patch_mlx_lm_attention()  # already routed: no-op
        assert not again.active
        q = mx.random.normal((1, 2, 1, 8))
        k = mx.random.normal((1, 2, 4, 8))
        out = base.scaled_dot_product_attention(q, k, k, None, scale=0.5, mask=None)
        ref = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.5, mask=None)
        assert np.allclose(np64(out), np64(ref), atol=1e-6)
    finally:
        patch.undo()
    assert base.scaled_dot_product_attention is original
    assert qwen3.scaled_dot_product_attention is original
    assert not patch.active


def test_swiglu_patch_routes_every_mlx_lm_user_and_undo_restores_it(rng):
    import mlx_lm.models.activations as act
    import mlx_lm.models.base as base
    import mlx_lm.models.qwen3 as qwen3
    import mlx_lm.models.switch_layers as switch_layers

    original, attention = act.swiglu, base.scaled_dot_product_attention
    patch = mlx_lm_patches.patch_mlx_lm_ops()
    try:
        assert {"mlx_lm.models.qwen3", "mlx_lm.models.switch_layers"} <= set(patch.module_names)
        assert qwen3.swiglu is act.swiglu is switch_layers.swiglu is not original
        assert base.scaled_dot_product_attention is not attention
        assert not mlx_lm_patches.patch_mlx_lm_swiglu().active  # already routed: no-op
        g = to_mx(rng.standard_normal((2, 3, 40)) * 4, mx.float32)
        x = to_mx(rng.standard_normal((2, 3, 40)), mx.float32)
        out = qwen3.swiglu(g, x)
        assert_close(out, swiglu_ref(np64(g), np64(x)), "float32", 8, "routed swiglu")
        # Broadcasting shapes (mlx-lm never passes them) keep mlx-lm's op.
        assert_close(qwen3.swiglu(g, x[:, :1]), swiglu_ref(np64(g), np64(x[:, :1])), "float32", 8, "broadcast")
    finally:
        patch.undo()
    assert act.swiglu is original and qwen3.swiglu is original and switch_layers.swiglu is original
    assert base.scaled_dot_product_attention is attention
    assert not patch.active


# ---------------------------------------------------------------------------
# Bad arguments


def test_bad_arguments_raise_errors_naming_them():
    x = mx.zeros((2, 3, 4, 8))
    w = mx.ones((8,))
    cases = [
        (lambda: mtplx_ext.rms_norm([1.0], w, 1e-5), TypeError, "x"),
        (lambda: mtplx_ext.rms_norm(x.astype(mx.int32), w, 1e-5), TypeError, "x"),
        (lambda: mtplx_ext.rms_norm(x, mx.ones((7,)), 1e-5), ValueError, "weight"),
        (lambda: mtplx_ext.rms_norm(x, w, -1.0), ValueError, "eps"),
        (lambda: mtplx_ext.rms_norm(x, w, "1e-5"), TypeError, "eps"),
        (lambda: mtplx_ext.rope(x[0, 0], 8, traditional=False, base=1e4, scale=1.0, offset=0), ValueError, "x"),
        (lambda: mtplx_ext.rope(x, 7, traditional=False, base=1e4, scale=1.0, offset=0), ValueError, "dims"),
        (lambda: mtplx_ext.rope(x, 16, traditional=False, base=1e4, scale=1.0, offset=0), ValueError, "dims"),
        (lambda: mtplx_ext.rope(x, 8, traditional=False, base=-1.0, scale=1.0, offset=0), ValueError, "base"),
        (lambda: mtplx_ext.rope(x, 8, traditional=1, base=1e4, scale=1.0, offset=0), TypeError, "traditional"),
        (lambda: mtplx_ext.rope(x, 8, traditional=False, base=1e4, scale=1.0, offset=1.5), TypeError, "offset"),
        (lambda: mtplx_ext.rope(x, 8, traditional=False, base=1e4, scale=1.0, offset=mx.array([1, 2, 3])), ValueError, "offset"),
        (lambda: mtplx_ext.rope(x, 8, traditional=False, base=1e4, scale=1.0, offset=mx.array([1.0, 2.0])), TypeError, "offset"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x[0], x, x, scale=1.0), ValueError, "queries"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x, x[:, :, :, :4], x, scale=1.0), ValueError, "keys"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x, x, x[:, :2], scale=1.0), ValueError, "values"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x, x[:, :2], x[:, :2], scale=1.0), ValueError, "keys"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x, x, x.astype(mx.int32), scale=1.0), TypeError, "values"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x, x, x, scale=1.0, mask="full"), ValueError, "mask"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x, x, x, scale=1.0, mask=mx.ones((5, 4), mx.bool_)), ValueError, "mask"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x, x, x, scale=1.0, mask=[1]), TypeError, "mask"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x.astype(mx.float16), x.astype(mx.float16), x.astype(mx.float16), scale=1.0, mask=mx.zeros((4, 4))), ValueError, "mask"),
        (lambda: mtplx_ext.scaled_dot_product_attention(x, x, x, scale=float("nan")), ValueError, "scale"),
        (lambda: mtplx_ext.swiglu(x, x[..., :4]), ValueError, "gate and x"),
        (lambda: mtplx_ext.swiglu(x.astype(mx.int32), x), TypeError, "gate"),
        (lambda: mtplx_ext.swiglu(x, [1.0]), TypeError, "x"),
        (lambda: mtplx_ext.swiglu(mx.array(1.0), mx.array(1.0)), ValueError, "gate"),
        (lambda: fused_modules.fuse_cpu_ops("model"), TypeError, "model"),
    ]
    for i, (call, exc, name) in enumerate(cases):
        with pytest.raises(exc, match=name):
            call()
