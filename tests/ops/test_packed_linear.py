"""The packed CPU decode GEMM (`mtplx_ext.ops.linear`) against float64 references.

Fresh random inputs every run (the seed is printed); outputs land in buffers
poisoned first. The error bound is the one of any ordered float32 sum of K
products with FMAs, (K + 1) u sum |x_k w_k|: it would reject a kernel that
drops or repeats a term (the checks below make sure such a term exceeds it).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx_ext.ops import linear as L
from mtplx_ext.ops.threads import set_cpu_threads
from _isa import ISAS, isa_fixture, runnable
from _poison import poison_allocator
import _seed

U = 2.0**-24


@pytest.fixture
def rng() -> np.random.Generator:
    seed = _seed.fresh()
    print(f"random seed {seed}")
    return np.random.default_rng(seed)




isa = isa_fixture(L.set_packed_linear_isa, "kernel")



def reference(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x @ w.T in float64 and the error bound of an ordered float32 FMA chain."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    bound = (w.shape[1] + 1) * U * (np.abs(x64) @ np.abs(w64).T)
    return ref, bound


def run(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    wp = L.pack_linear_weight(mx.array(w))
    xm = mx.array(x)
    mx.eval(wp, xm)
    poison_allocator(4 * int(np.prod(x.shape[:-1], dtype=np.int64)) * w.shape[0] + 4)
    y = L.packed_linear(xm, wp, w.shape[0])
    return np.array(y)


@pytest.mark.parametrize("K", [1, 3, 64, 257, 600])
@pytest.mark.parametrize("N", [1, 47, 48, 49, 200])
def test_matches_float64_reference(rng, isa: str, K: int, N: int) -> None:
    w = rng.standard_normal((N, K)).astype(np.float32)
    # The last k's weights kept away from 0, so dropping that term exceeds the bound for most rows even at N = 1.
    w[:, -1] = np.sign(w[:, -1]) * (1 + np.abs(w[:, -1]))
    detectable = []
    for M in (1, 2, 7, 8, 9, 17, 33, 64, 65, 130):
        x = rng.standard_normal((M, K)).astype(np.float32)
        ref, bound = reference(x, w)
        y = run(x, w)
        assert y.shape == (M, N) and y.dtype == np.float32
        err = np.abs(y - ref)
        assert np.all(err <= bound), f"M={M}: worst excess {np.max(err - bound)}"
        # A kernel that skipped the last k would be caught wherever that term exceeds the bound.
        dropped = np.abs(x[:, -1:].astype(np.float64) * w[:, -1].astype(np.float64)[None, :])
        detectable.append((dropped > bound).ravel())
    # Over every M together: one row of one column is a single coin.
    assert np.mean(np.concatenate(detectable)) > 0.1


def test_leading_dims_and_noncontiguous_x(rng) -> None:
    K, N = 96, 100
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((3, 5, 2 * K)).astype(np.float32)
    xs = mx.array(x)[..., ::2]  # strided view
    wp = L.pack_linear_weight(mx.array(w))
    y = np.array(L.packed_linear(xs, wp, N))
    ref, bound = reference(x[..., ::2].reshape(-1, K), w)
    assert y.shape == (3, 5, N)
    assert np.all(np.abs(y.reshape(-1, N) - ref) <= bound)


def test_strided_packed_weight_equals_its_dense_copy(rng) -> None:
    """A w_packed view that is not row contiguous (a transpose) is read through its strides."""
    K, N = 40, 96
    wp = L.pack_linear_weight(mx.array(rng.standard_normal((N, K)).astype(np.float32)))
    view = mx.swapaxes(mx.contiguous(mx.swapaxes(wp, 1, 2)), 1, 2)  # same values and shape, strided
    x = mx.array(rng.standard_normal((6, K)).astype(np.float32))
    mx.eval(wp, view, x)
    assert view.shape == wp.shape
    assert mx.array_equal(L.packed_linear(x, view, N), L.packed_linear(x, wp, N)).item()


def test_rows_independent_of_the_call_and_threads(rng, isa: str) -> None:
    """A row's result is bit for bit the same alone, in any batch, on 1 or 2 threads."""
    K, N = 640, 500  # 1.3 MB of weights: split over threads
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    wp = L.pack_linear_weight(w)
    x = mx.array(rng.standard_normal((70, K)).astype(np.float32))
    mx.eval(wp, x)
    outs = []
    previous = set_cpu_threads(2)
    try:
        for threads in (1, 2):
            set_cpu_threads(threads)
            full = L.packed_linear(x, wp, N)
            alone = [L.packed_linear(x[i : i + 1], wp, N) for i in (0, 9, 33, 69)]
            part = L.packed_linear(x[5:29], wp, N)
            mx.eval(full, alone, part)
            for j, i in enumerate((0, 9, 33, 69)):
                assert mx.array_equal(full[i : i + 1], alone[j]).item()
            assert mx.array_equal(full[5:29], part).item()
            outs.append(full)
    finally:
        set_cpu_threads(previous)
    assert mx.array_equal(outs[0], outs[1]).item()


def test_pack_round_trip_and_padding(rng) -> None:
    for N, K in ((1, 5), (48, 7), (50, 33), (97, 2)):
        w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
        wp = L.pack_linear_weight(w)
        P = -(-N // L.PANEL)
        assert wp.shape == (P, K, L.PANEL)
        assert mx.array_equal(L.unpack_linear_weight(wp, N), w).item()
        flat = np.array(wp).transpose(0, 2, 1).reshape(P * L.PANEL, K)
        assert np.all(flat[N:] == 0)


def test_compiled_and_shapeless(rng) -> None:
    K, N = 80, 130
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    wp = L.pack_linear_weight(w)
    mx.eval(wp)
    f = mx.compile(lambda x: L.packed_linear(x, wp, N), shapeless=True)
    for M in (1, 4, 11):
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
        assert mx.array_equal(f(x), L.packed_linear(x, wp, N)).item()


def test_empty_rows() -> None:
    wp = L.pack_linear_weight(mx.ones((10, 4)))
    y = L.packed_linear(mx.zeros((0, 4)), wp, 10)
    assert y.shape == (0, 10)


@pytest.mark.parametrize(
    "call, exc, name",
    [
        (lambda wp: L.packed_linear(mx.zeros((2, 8), dtype=mx.float16), wp, 50), ValueError, "x"),
        (lambda wp: L.packed_linear(mx.zeros((2, 9)), wp, 50), ValueError, "x"),
        (lambda wp: L.packed_linear(mx.zeros((2, 8)), wp, 48), ValueError, "n"),
        (lambda wp: L.packed_linear(mx.zeros((2, 8)), wp, 97), ValueError, "n"),
        (lambda wp: L.packed_linear(mx.zeros((2, 8)), wp, 0), ValueError, "n"),
        (lambda wp: L.packed_linear(mx.zeros((2, 8)), wp, 50.0), TypeError, "n"),
        (lambda wp: L.packed_linear([1.0], wp, 50), TypeError, "x"),
        (lambda wp: L.packed_linear(mx.zeros((2, 8)), wp[:, :, :40], 50), ValueError, "w_packed"),
        (lambda wp: L.packed_linear(mx.zeros((2, 8)), wp.astype(mx.float16), 50), ValueError, "w_packed"),
        (lambda wp: L.pack_linear_weight(mx.zeros((3, 4, 5))), ValueError, "weight"),
        (lambda wp: L.pack_linear_weight(mx.zeros((3, 4), dtype=mx.bfloat16)), ValueError, "weight"),
        (lambda wp: L.unpack_linear_weight(wp, 200), ValueError, "n"),
    ],
)
def test_bad_inputs_name_the_argument(call, exc, name: str) -> None:
    wp = L.pack_linear_weight(mx.ones((50, 8)))
    with pytest.raises(exc, match=rf"\b{name}\b"):
        mx.eval(call(wp))


def test_isa_is_known() -> None:
    assert L.packed_linear_isa() in ("avx512", "avx2", "neon", "generic")


def test_every_kernel_gives_the_same_bits(rng) -> None:
    """One FMA chain per element in k order: the kernels of every instruction set agree bit for bit.

    Row counts across every tile size (8-row AVX-512 tiles, 4-row AVX2 and
    generic ones, the 64-row blocks), K across the 256-k chunks, N with a
    partial last panel, on one thread and on two.
    """
    isas = [i for i in ISAS if runnable(L.set_packed_linear_isa, i)]
    assert "generic" in isas
    K, N = int(rng.integers(257, 700)), int(rng.integers(200, 400))
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    wp = L.pack_linear_weight(w)
    x = mx.array(rng.standard_normal((int(rng.integers(65, 140)), K)).astype(np.float32))
    mx.eval(wp, x)
    previous = set_cpu_threads(1)
    try:
        outs = {}
        for threads in (1, 2):
            set_cpu_threads(threads)
            for i in isas:
                L.set_packed_linear_isa(i)
                for M in (1, 3, 5, 8, 9, 13, 24, 33, int(x.shape[0])):
                    outs[i, threads, M] = L.packed_linear(x[:M], wp, N)
                    mx.eval(outs[i, threads, M])
    finally:
        L.set_packed_linear_isa("")
        set_cpu_threads(previous)
    ref = outs["generic", 1, int(x.shape[0])]
    for (i, threads, M), y in outs.items():
        assert mx.array_equal(y, ref[:M]).item(), f"{i}, {threads} thread(s), M={M}"


@pytest.mark.parametrize("bad, exc", [("sse", ValueError), ("neon ", ValueError), (3, TypeError)])
def test_an_unknown_kernel_is_refused_naming_isa(bad, exc) -> None:
    with pytest.raises(exc, match=r"\bisa\b"):
        L.set_packed_linear_isa(bad)
    assert L.packed_linear_isa() in ("avx512", "avx2", "neon", "generic")
