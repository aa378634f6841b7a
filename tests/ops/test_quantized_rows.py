"""Rows of a packed quantized weight (the quantized embedding's lookup) and the product's prefetch argument.

Fresh random weights every run (the seed is printed); outputs land in
buffers poisoned first. The oracle is mlx itself: the rows of the weight as
`mx.quantize` stored them, and `mx.dequantize` of those rows, bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx_ext.ops import qlinear as Q
from mtplx_ext.ops.threads import set_cpu_threads
from _poison import poison_allocator
import _seed

SCALES = (mx.float32, mx.float16, mx.bfloat16)


@pytest.fixture
def rng() -> np.random.Generator:
    seed = _seed.fresh()
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def _weight(rng, n: int, gs: int, bits: int, dtype):
    w = mx.array((rng.standard_normal((n, 3 * gs)) * 4).astype(np.float32)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    packed = Q.pack_quantized_weight(wq, s, b, gs, bits)
    mx.eval(wq, s, b, packed)
    return wq, s, b, packed


@pytest.mark.parametrize("bits", Q.BITS)
@pytest.mark.parametrize("dtype", SCALES)
def test_rows_and_embedding_are_mlx_s_bit_for_bit(rng, bits: int, dtype) -> None:
    gs = int(rng.choice(Q.GROUP_SIZES))
    n = int(rng.integers(65, 200))  # a partial last panel
    wq, s, b, packed = _weight(rng, n, gs, bits, dtype)
    ids = mx.array(np.concatenate([[0, n - 1], rng.integers(0, n, 10)]).reshape(3, 4).astype(np.int32))
    poison_allocator(4 * 12 * 3 * gs)
    got = Q.unpack_quantized_rows(*packed, ids, gs, bits, n)  # the extension's node
    want = (wq[ids], s[ids], b[ids])
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and mx.array_equal(g, w).item()
    # The mlx-op graph (GPU fallback) gives the same rows.
    ref = Q.unpack_quantized_rows(*packed, ids, gs, bits)
    assert all(mx.array_equal(g, r).item() for g, r in zip(got, ref))
    poison_allocator(4 * 12 * 3 * gs)
    emb = Q.packed_quantized_embedding(*packed, ids, n, gs, bits)
    deq = mx.dequantize(*want, group_size=gs, bits=bits)
    assert emb.dtype == deq.dtype == dtype and emb.shape == (3, 4, 3 * gs)
    assert mx.array_equal(emb, deq).item()


def test_ids_are_clamped_and_bad_arguments_are_named(rng) -> None:
    n, gs, bits = 70, 32, 4
    wq, s, b, packed = _weight(rng, n, gs, bits, mx.float32)
    ids = mx.array([-5, 0, n - 1, n, n + 100])
    clamped = mx.array([0, 0, n - 1, n - 1, n - 1])
    assert mx.array_equal(Q.packed_quantized_embedding(*packed, ids, n, gs, bits),
                          Q.packed_quantized_embedding(*packed, clamped, n, gs, bits)).item()
    with pytest.raises(ValueError, match="ids"):
        Q.packed_quantized_embedding(*packed, mx.array([1.0]), n, gs, bits)
    with pytest.raises(ValueError, match="wq"):
        Q.packed_quantized_embedding(packed[0].astype(mx.int8), packed[1], ids, n, gs, bits)
    with pytest.raises(ValueError, match="group_size"):
        Q.packed_quantized_embedding(*packed, ids, n, 48, bits)
    with pytest.raises(ValueError, match="n"):
        Q.packed_quantized_embedding(*packed, ids, n + 64, gs, bits)


def test_prefetch_of_the_next_weight_changes_no_bit(rng) -> None:
    """The idle worker's prefetch only moves memory toward the caches: products are the same bits."""
    gs, bits = 64, 4
    first = _weight(rng, 1100, gs, bits, mx.bfloat16)[3]  # over the split threshold: both threads run it
    nxt = _weight(rng, 300, gs, bits, mx.bfloat16)[3]
    x = mx.array(rng.standard_normal((5, 3 * gs)).astype(np.float32))
    previous = set_cpu_threads(2)
    try:
        want = Q.packed_quantized_linear(x, *first, 1100, gs, bits)
        mx.eval(want)
        for _ in range(3):
            poison_allocator(4 * 5 * 1100)
            y = Q.packed_quantized_linear(x, *first, 1100, gs, bits, prefetch=nxt)
            z = Q.packed_quantized_linear(y[:, : 3 * gs], *nxt, 300, gs, bits, prefetch=first)
            assert mx.array_equal(y, want).item()
            assert mx.array_equal(z, Q.packed_quantized_linear(want[:, : 3 * gs], *nxt, 300, gs, bits)).item()
    finally:
        set_cpu_threads(previous)
    for bad in ((nxt[0],), (nxt[1], nxt[0]), (nxt[0], nxt[1], nxt[1])):
        with pytest.raises(ValueError, match="prefetch"):
            Q.packed_quantized_linear(x, *first, 1100, gs, bits, prefetch=bad)
