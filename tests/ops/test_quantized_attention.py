"""Attention over quantized KV (`quantized_scaled_dot_product_attention`) against float64.

The reference dequantizes the packed keys and values in float64 from the
bit layout written out here (LSB-first fields of `bits` bits in uint32 words,
`scale * q + bias` per group), not with MLX's dequantize, then runs float64
attention. Inputs are fresh every run (the seed is printed). A kernel that
skips or double-counts a chunk of keys, drops a group's scale or bias, or
misreads a field is caught: the test of its power below shows the same
comparison rejecting each such variant of the reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_lm_qsdpa

import mtplx_ext
from mtplx_ext.ops.threads import cpu_pool_jobs, set_cpu_threads
from _attention import sdpa_ref
import _seed

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
UNIT = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


@pytest.fixture
def rng() -> np.random.Generator:
    seed = _seed.fresh()
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def np64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def unpack(parts: tuple[mx.array, mx.array, mx.array], bits: int, group: int) -> np.ndarray:
    """float64 [.., S, D] from (packed uint32, scales, biases), from the bit layout."""
    w = np.array(parts[0]).astype(np.uint64)
    words = w.shape[-1]
    D = words * 32 // bits
    # The row as one little-endian bit stream: field d holds bits [d * bits, (d + 1) * bits).
    bitstream = np.zeros(w.shape[:-1] + (words * 32,), np.uint8)
    for j in range(32):
        bitstream[..., j::32] = (w >> np.uint64(j)) & np.uint64(1)
    fields = bitstream.reshape(w.shape[:-1] + (D, bits))
    q = (fields.astype(np.int64) << np.arange(bits)).sum(-1).astype(np.float64)
    s = np.repeat(np64(parts[1]), group, axis=-1)
    b = np.repeat(np64(parts[2]), group, axis=-1)
    return s * q + b


def quantize(rng, shape, bits, group, dt):
    x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
    parts = tuple(mx.quantize(x, group_size=group, bits=bits))
    mx.eval(parts)
    return parts


def ragged_mask(rng, B, T, S):
    """[B, 1, T, S] bool as the ragged cache builds it: stream b sees [pad_b, end_b + t]."""
    pads = rng.integers(0, max(1, S // 4), B)
    ends = np.array([int(rng.integers(p, S - T + 1)) for p in pads])
    slot = np.arange(S)
    keep = np.stack([(slot[None] >= pads[b]) & (slot[None] <= ends[b] + np.arange(T)[:, None]) for b in range(B)])
    return keep[:, None]


def check(got: mx.array, ref: np.ndarray, dtype: str, ulps: float, what: str) -> float:
    g = np64(got)
    assert g.shape == ref.shape, what
    assert np.array_equal(np.isnan(g), np.isnan(ref)), f"{what}: NaN pattern differs"
    scale = np.maximum(np.abs(np.nan_to_num(ref)).max(axis=-1, keepdims=True), 1e-3)
    worst = float(np.max(np.abs(np.nan_to_num(g - ref)) / (ulps * UNIT[dtype] * scale)))
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the tolerance of {ulps} ulps"
    return worst


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_matches_float64_attention_over_the_dequantized_kv(rng, dtype, bits):
    dt = DTYPES[dtype]
    for T, S, mask_kind in ((1, 37, "ragged"), (4, 300, "ragged"), (9, 70, "causal"), (3, 41, "none"), (2, 90, "additive")):
        group = int(rng.choice([32, 64, 128]))
        D = group * int(rng.integers(1, 3))
        Dv = group * int(rng.integers(1, 3))
        B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
        Hq = Hkv * int(rng.choice([1, 2, 4]))
        q = mx.array(rng.standard_normal((B, Hq, T, D)).astype(np.float32)).astype(dt)
        k = quantize(rng, (B, Hkv, S, D), bits, group, dt)
        v = quantize(rng, (B, Hkv, S, Dv), bits, group, dt)
        scale = float(D**-0.5 * rng.uniform(0.5, 2.0))
        mask = ref_mask = None
        if mask_kind == "ragged":
            ref_mask = ragged_mask(rng, B, T, S)
            mask = mx.array(ref_mask)
        elif mask_kind == "causal":
            mask = ref_mask = "causal"
        elif mask_kind == "additive":
            add = rng.standard_normal((B, 1, T, S))
            mask = mx.array(add.astype(np.float32)).astype(dt)
            ref_mask = np64(mask)
        got = mtplx_ext.quantized_scaled_dot_product_attention(
            q, k, v, scale=scale, bits=bits, group_size=group, mask=mask
        )
        assert got.dtype == dt and tuple(got.shape) == (B, Hq, T, Dv)
        ref = sdpa_ref(np64(q), unpack(k, bits, group), unpack(v, bits, group), scale, ref_mask,
                       float(mx.finfo(dt).min))
        what = f"{bits}-bit g{group} T {T} S {S} Hq {Hq} Hkv {Hkv} D {D} Dv {Dv} {mask_kind}"
        # float32 softmax and sums over up to 300 keys; 16-bit outputs round once.
        check(got, ref, dtype, 256 if dtype == "float32" else 1.5, what)


def test_the_comparison_rejects_a_skipped_or_doubled_key_chunk_a_lost_bias_and_a_misread_field(rng):
    """The power of the test above: the same bound rejects references built wrong."""
    B, Hq, Hkv, T, S, D, bits, group = 1, 4, 2, 3, 200, 64, 4, 32
    q = mx.array(rng.standard_normal((B, Hq, T, D)).astype(np.float32))
    k = quantize(rng, (B, Hkv, S, D), bits, group, mx.float32)
    v = quantize(rng, (B, Hkv, S, D), bits, group, mx.float32)
    got = mtplx_ext.quantized_scaled_dot_product_attention(q, k, v, scale=0.125, bits=bits, group_size=group)
    kd, vd = unpack(k, bits, group), unpack(v, bits, group)
    check(got, sdpa_ref(np64(q), kd, vd, 0.125, None, -3e38), "float32", 256, "right reference")
    chunk = slice(64, 96)  # one chunk of 32 keys
    skipped = np.ones(S, bool)
    skipped[chunk] = False
    doubled = np.concatenate([np.arange(S), np.arange(S)[chunk]])
    no_bias = kd - np.repeat(np64(k[2]), group, -1)  # scale * q only
    misread = kd.copy()
    misread[..., 0::2], misread[..., 1::2] = kd[..., 1::2], kd[..., 0::2]  # nibbles swapped
    wrong = {
        "skipped chunk": (kd[:, :, skipped], vd[:, :, skipped]),
        "doubled chunk": (kd[:, :, doubled], vd[:, :, doubled]),
        "lost bias": (no_bias, vd),
        "swapped nibbles": (misread, vd),
    }
    for name, (kk, vv) in wrong.items():
        with pytest.raises(AssertionError):
            check(got, sdpa_ref(np64(q), kk, vv, 0.125, None, -3e38), "float32", 256, name)


def test_a_row_gives_the_same_bits_alone_as_in_a_verification_and_on_two_threads(rng):
    """Position t of a [B, K + 1] verification equals a one-token step at t, bit for bit (MTP stays
    lossless); a stream's rows do not depend on the batch's other streams; threads change no bit."""
    B, Hq, Hkv, T, S, D, bits, group = 3, 8, 2, 5, 1500, 128, 8, 64
    q = mx.array(rng.standard_normal((B, Hq, T, D)).astype(np.float32))
    k = quantize(rng, (B, Hkv, S, D), bits, group, mx.float32)
    v = quantize(rng, (B, Hkv, S, D), bits, group, mx.float32)
    mask = mx.array(ragged_mask(rng, B, T, S))
    f = lambda qq, kk, vv, m: mtplx_ext.quantized_scaled_dot_product_attention(  # noqa: E731
        qq, kk, vv, scale=0.09, bits=bits, group_size=group, mask=m)
    outs = {}
    try:
        for n in (1, 2):
            set_cpu_threads(n)
            before = cpu_pool_jobs()
            outs[n] = np.array(f(q, k, v, mask))
            jobs = cpu_pool_jobs() - before
            assert (jobs > 0) == (n == 2), f"{n} threads ran {jobs} pool jobs"
    finally:
        set_cpu_threads(0)
    np.testing.assert_array_equal(outs[1], outs[2])
    alone = [f(q[:, :, t : t + 1], k, v, mask[:, :, t : t + 1]) for t in range(T)]
    np.testing.assert_array_equal(np.array(mx.concatenate(alone, axis=2)), outs[1])
    for b in range(B):
        kb, vb = tuple(a[b : b + 1] for a in k), tuple(a[b : b + 1] for a in v)
        np.testing.assert_array_equal(np.array(f(q[b : b + 1], kb, vb, mask[b : b + 1])), outs[1][b : b + 1])


def test_agrees_with_mlx_lm_quantized_attention_and_reads_cache_slices(rng):
    """mlx-lm's own quantized attention (the peer) on the first S slots of a longer cache buffer."""
    B, Hq, Hkv, T, S, D, bits, group = 2, 6, 2, 4, 130, 128, 8, 64
    q = mx.array(rng.standard_normal((B, Hq, T, D)).astype(np.float32))
    kbuf = quantize(rng, (B, Hkv, 256, D), bits, group, mx.float32)
    vbuf = quantize(rng, (B, Hkv, 256, D), bits, group, mx.float32)
    k = tuple(a[:, :, :S] for a in kbuf)
    v = tuple(a[:, :, :S] for a in vbuf)
    mask = mx.array(ragged_mask(rng, B, T, S))
    got = mtplx_ext.quantized_scaled_dot_product_attention(q, k, v, scale=0.1, bits=bits, group_size=group, mask=mask)
    peer = mlx_lm_qsdpa(q, k, v, scale=0.1, mask=mask, group_size=group, bits=bits)
    check(got, np64(peer), "float32", 512, "vs mlx-lm")


def test_bad_arguments_are_named_before_any_kernel_runs(rng):
    q = mx.zeros((1, 2, 1, 64))
    k = quantize(rng, (1, 1, 8, 64), 8, 64, mx.float32)
    ok = dict(scale=0.1, bits=8, group_size=64)
    f = mtplx_ext.quantized_scaled_dot_product_attention
    with pytest.raises(ValueError, match="bits"):
        f(q, k, k, **{**ok, "bits": 7})
    with pytest.raises(ValueError, match="group_size"):
        f(q, k, k, **{**ok, "group_size": 16})
    with pytest.raises(ValueError, match="keys"):
        f(q, k, k, **{**ok, "bits": 4})  # 8-bit words read as 4-bit: the row widths disagree
    with pytest.raises(TypeError, match="keys"):
        f(q, k[:2], k, **ok)
    with pytest.raises(ValueError, match="values"):
        f(q, k, tuple(a[:, :, :5] for a in k), **ok)
    with pytest.raises(ValueError, match="D = 32"):
        f(mx.zeros((1, 2, 1, 32)), k, k, **ok)
    with pytest.raises(ValueError, match="mask"):
        f(q, k, k, **ok, mask=mx.zeros((1, 1, 2, 8), mx.bool_))
    with pytest.raises(ValueError, match="uint32"):
        f(q, (k[0].astype(mx.int32), k[1], k[2]), k, **ok)
