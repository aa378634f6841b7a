"""The quantized CPU GEMM (`mtplx_ext.ops.qlinear`) against float64 references of the dequantized product.

Fresh random weights and activations every run (the seed is printed);
outputs land in buffers poisoned first. The kernel's one approximation is
the int8 rounding of the activations per row and group (d = max|x_g| / 127,
q centred at c = 2^(bits - 1)), so every output must lie within
    sum_g |s| d_g / 2 sum_k |q - c|  +  2^-20 sum_k |w x|
of the float64 product (the second term covers float32 rounding in the
fold). The checks make sure a dropped group scale, bias or nibble exceeds
that bound, so a kernel that lost one would fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx_ext.ops import qlinear as Q
from mtplx_ext.ops.threads import set_cpu_threads
from _isa import ISAS, isa_fixture, runnable
from _poison import poison_allocator
import _seed

SCALES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.fixture
def rng() -> np.random.Generator:
    seed = _seed.fresh()
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


# "amx": AMX-INT8 tiles for calls of 8 rows or more (16 at bytes), where the CPU and OS allow them.
QISAS = ("amx", *ISAS)
isa = isa_fixture(Q.set_packed_quantized_linear_isa, "quantized kernel", QISAS)



class Weight:
    """A random weight quantized by mlx, its float64 parts, and its packed form."""

    def __init__(self, rng: np.random.Generator, n: int, k: int, gs: int, bits: int, dtype=mx.float32):
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)
        self.wq, self.s, self.b = mx.quantize(w, group_size=gs, bits=bits)
        self.n, self.k, self.gs, self.bits = n, k, gs, bits
        self.q = np.array(Q.unpack_bits(self.wq, bits, k)).astype(np.float64)  # [n, k]
        self.s64 = np.array(self.s.astype(mx.float32)).astype(np.float64)  # [n, G]
        self.b64 = np.array(self.b.astype(mx.float32)).astype(np.float64)
        self.packed = Q.pack_quantized_weight(self.wq, self.s, self.b, gs, bits)
        mx.eval(self.packed)

    def dense(self, s=None, b=None, q=None) -> np.ndarray:
        s, b, q = (self.s64 if s is None else s), (self.b64 if b is None else b), (self.q if q is None else q)
        return q * np.repeat(s, self.gs, axis=1) + np.repeat(b, self.gs, axis=1)

    def bound(self, x: np.ndarray) -> np.ndarray:
        """The activations' rounding bound per output [M, n] (module docstring)."""
        G = self.k // self.gs
        d = np.abs(x.astype(np.float64)).reshape(len(x), G, self.gs).max(axis=2) / 127  # [M, G]
        c = 2 ** (self.bits - 1)
        qdev = np.abs(self.q - c).reshape(self.n, G, self.gs).sum(axis=2)  # [n, G]
        rounding = (d / 2) @ (np.abs(self.s64) * qdev).T
        return rounding + 2.0**-20 * (np.abs(x.astype(np.float64)) @ np.abs(self.dense()).T)

    def run(self, x: np.ndarray, dtype=mx.float32) -> np.ndarray:
        xm = mx.array(x).astype(dtype)
        mx.eval(xm)
        poison_allocator(4 * len(x) * self.n + 4)
        y = Q.packed_quantized_linear(xm, *self.packed, self.n, self.gs, self.bits)
        return np.array(y.astype(mx.float32))


@pytest.mark.parametrize("bits", Q.BITS)
@pytest.mark.parametrize("gs", Q.GROUP_SIZES)
@pytest.mark.parametrize("scale", sorted(SCALES))
def test_matches_float64_reference_and_catches_a_dropped_term(rng, bits: int, gs: int, scale: str) -> None:
    n, k = 70, 2 * gs  # a partial second panel; two groups
    W = Weight(rng, n, k, gs, bits, SCALES[scale])
    ref_w = W.dense()
    caught = {"scale": [], "bias": [], "nibble": []}
    for M in (1, 2, 3, 4, 5, 9, 17, 64, 65):
        x = rng.standard_normal((M, k)).astype(np.float32)
        y = W.run(x)
        ref = x.astype(np.float64) @ ref_w.T
        bound = W.bound(x)
        assert y.shape == (M, n)
        excess = np.abs(y - ref) - bound
        assert np.all(excess <= 0), f"M={M}: worst excess {excess.max()}"
        # Broken weights a kernel could compute by mistake: group 1's scale taken as 1, its bias dropped,
        # the last value's q dropped (the high nibble of its byte at bits <= 4).
        s = W.s64.copy(); s[:, 1] = 1.0
        b = W.b64.copy(); b[:, 1] = 0.0
        q = W.q.copy(); q[:, -1] = 0.0
        for name, wrong in (("scale", W.dense(s=s)), ("bias", W.dense(b=b)), ("nibble", W.dense(q=q))):
            caught[name].append((np.abs(x.astype(np.float64) @ wrong.T - ref) > bound).ravel())
    for name, hits in caught.items():
        # Over every M together; a dropped q only matters where it is not 0 already.
        assert np.mean(np.concatenate(hits)) > 0.2, f"a dropped {name} would stay inside the bound"


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_activations_give_mlx_dtype_and_the_float_rows_result(rng, dtype) -> None:
    W = Weight(rng, 100, 128, 64, 4, dtype)
    x = np.array(mx.array(rng.standard_normal((3, 128)).astype(np.float32)).astype(dtype).astype(mx.float32))
    xm = mx.array(x).astype(dtype)
    y = Q.packed_quantized_linear(xm, *W.packed, W.n, W.gs, W.bits)
    assert y.dtype == mx.quantized_matmul(xm, W.wq, W.s, W.b, transpose=True, group_size=64, bits=4).dtype
    y32 = Q.packed_quantized_linear(mx.array(x), *W.packed, W.n, W.gs, W.bits)
    assert mx.array_equal(y, y32.astype(y.dtype)).item()


def test_every_kernel_gives_the_same_bits_on_one_and_two_threads(rng) -> None:
    """Exact integer sums and one fixed fold order: every instruction set and thread split agrees bit for bit."""
    runs = [i for i in QISAS if runnable(Q.set_packed_quantized_linear_isa, i)]
    for bits in (3, 4, 8):
        W = Weight(rng, 1100, 512, 64, bits)  # over 1 MiB at 8 bits: split over threads
        x = rng.standard_normal((70, 512)).astype(np.float32)
        outs = []
        previous = set_cpu_threads(2)
        try:
            for threads in (1, 2):
                set_cpu_threads(threads)
                for isa in runs:
                    Q.set_packed_quantized_linear_isa(isa)
                    outs.append((threads, isa, W.run(x)))
        finally:
            Q.set_packed_quantized_linear_isa("")
            set_cpu_threads(previous)
        for threads, isa, y in outs[1:]:
            assert np.array_equal(y, outs[0][2]), f"bits {bits}: {isa} on {threads} threads differs"


def test_rows_independent_of_the_call(rng, isa: str) -> None:
    """A row's bits are the same alone and in any batch (a verification row is the plain step's)."""
    W = Weight(rng, 300, 256, 32, 4)
    x = rng.standard_normal((70, 256)).astype(np.float32)
    full = W.run(x)
    for i in (0, 3, 4, 9, 64, 69):
        assert np.array_equal(W.run(x[i : i + 1])[0], full[i])
    assert np.array_equal(W.run(x[5:29]), full[5:29])


def test_non_finite_activations_poison_only_their_row(rng) -> None:
    W = Weight(rng, 64, 128, 64, 4)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    x[1, 70] = np.nan
    y = W.run(x)
    assert np.all(np.isnan(y[1])) and np.all(np.isfinite(y[[0, 2]]))


@pytest.mark.parametrize("bits", Q.BITS)
def test_pack_round_trip_bit_for_bit(rng, bits: int) -> None:
    for n, gs in ((1, 32), (64, 64), (130, 128)):
        W = Weight(rng, n, 2 * gs, gs, bits, mx.bfloat16)
        wq, s, b = Q.unpack_quantized_weight(*W.packed, n, gs, bits)
        assert mx.array_equal(wq, W.wq).item() and mx.array_equal(s, W.s).item() and mx.array_equal(b, W.b).item()
        rows = mx.array([[n - 1, 0], [n // 2, n - 1]])
        wr, sr, br = Q.unpack_quantized_rows(*W.packed, rows, gs, bits)
        assert mx.array_equal(wr, W.wq[rows]).item() and mx.array_equal(sr, W.s[rows]).item()


def test_leading_dims_strided_x_and_compiled(rng) -> None:
    W = Weight(rng, 90, 64, 32, 4)
    x = mx.array(rng.standard_normal((2, 3, 128)).astype(np.float32))[..., ::2]
    y = Q.packed_quantized_linear(x, *W.packed, W.n, 32, 4)
    assert y.shape == (2, 3, 90)
    dense = np.array(Q.packed_quantized_linear(mx.contiguous(x).reshape(6, 64), *W.packed, W.n, 32, 4))
    assert np.array_equal(np.array(y).reshape(6, 90), dense)
    f = mx.compile(lambda v: Q.packed_quantized_linear(v, *W.packed, W.n, 32, 4), shapeless=True)
    for M in (1, 5):
        v = mx.array(rng.standard_normal((M, 64)).astype(np.float32))
        assert mx.array_equal(f(v), Q.packed_quantized_linear(v, *W.packed, W.n, 32, 4)).item()
    assert Q.packed_quantized_linear(mx.zeros((0, 64)), *W.packed, W.n, 32, 4).shape == (0, 90)


@pytest.mark.parametrize(
    "call, exc, name",
    [
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64), dtype=mx.int32), wq, sb, 70, 32, 4), ValueError, "x"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 63)), wq, sb, 70, 32, 4), ValueError, "x"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb, 64, 32, 4), ValueError, "n"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb, 129, 32, 4), ValueError, "n"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb, 70, 64, 4), ValueError, "wq"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb, 70, 48, 4), ValueError, "group_size"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb, 70, 32, 7), ValueError, "bits"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb, 70, 32, 8), ValueError, "wq"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq.astype(mx.int8), sb, 70, 32, 4), ValueError, "wq"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb[:1], 70, 32, 4), ValueError, "sb"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb.astype(mx.int32), 70, 32, 4), ValueError, "sb"),
        (lambda wq, sb: Q.packed_quantized_linear([1.0], wq, sb, 70, 32, 4), TypeError, "x"),
        (lambda wq, sb: Q.packed_quantized_linear(mx.zeros((2, 64)), wq, sb, 70.0, 32, 4), TypeError, "n"),
        (lambda wq, sb: Q.pack_quantized_weight(mx.zeros((4, 8), dtype=mx.uint32), mx.zeros((4, 3)), mx.zeros((4, 2)), 32, 4), ValueError, "scales"),
        (lambda wq, sb: Q.pack_quantized_weight(mx.zeros((4, 8)), mx.zeros((4, 2)), mx.zeros((4, 2)), 32, 4), ValueError, "weight"),
        (lambda wq, sb: Q.pack_quantized_weight(mx.zeros((4, 8), dtype=mx.uint32), mx.zeros((4, 2)), mx.zeros((4, 2)), 32, 7), ValueError, "bits"),
    ],
)
def test_bad_inputs_name_the_argument(call, exc, name: str) -> None:
    wq, s, b = mx.quantize(mx.ones((70, 64)), group_size=32, bits=4)
    packed = Q.pack_quantized_weight(wq, s, b, 32, 4)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        mx.eval(call(*packed))


def test_isa_names() -> None:
    assert Q.packed_quantized_linear_isa() in QISAS
    with pytest.raises(ValueError, match=r"\bisa\b"):
        Q.set_packed_quantized_linear_isa("sse9")


def test_activation_rounding_ties_give_the_same_bits_on_every_kernel(rng) -> None:
    """Activations whose scaled values sit within float rounding of k + 1/2 round alike everywhere.

    x = (k + 1/2) * amax / 127 makes x * (127 / amax) land a rounding error
    away from a tie, so a kernel that fused the product into the rounding's
    add (an FMA), or rounded ties differently, gives other int8 values on a
    few percent of them, and other output bits.
    """
    runs = [i for i in QISAS if runnable(Q.set_packed_quantized_linear_isa, i)]
    W = Weight(rng, 64, 2048, 64, 4)
    amax = rng.uniform(0.5, 3.0, size=(256, 1))
    k = rng.integers(-126, 126, size=(256, 2048)) + 0.5
    x = (k * amax / 127).astype(np.float32)
    x[:, ::64] = amax.astype(np.float32) * np.where(rng.random((256, 32)) < 0.5, 1, -1)  # each group's max
    outs = []
    try:
        for isa in runs:
            Q.set_packed_quantized_linear_isa(isa)
            outs.append((isa, W.run(x)))
    finally:
        Q.set_packed_quantized_linear_isa("")
    for isa, y in outs[1:]:
        assert np.array_equal(y, outs[0][1]), f"{isa} rounds activations differently from {outs[0][0]}"
