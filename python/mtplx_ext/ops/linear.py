"""Packed Linear weights and the CPU decode GEMM over them.

On MLX's CPU backend a decode or verification step multiplies a few rows of
activations by every weight matrix of the model. Over a row-major weight the
product can only be formed from dot products, which read the activations
again from L2 for every few columns; packing each weight once, at load time,
into panels of 48 output columns (`pack_linear_weight`) turns the inner step
into rank-1 updates that stream the weight once per call and read each
activation 4 bytes at a time (`packed_linear`). Every output element is one
FMA chain over the input dimension in order, so a row's result does not
depend on the other rows of the call: a verification of K + 1 tokens
computes each row exactly as a plain step would.

CPU streams only (`packed_linear` refuses GPU streams: MLX's Metal matmul
needs no packing); float32 only; inference only (no gradients).
"""

from __future__ import annotations

import mlx.core as mx

from mtplx_ext import _ext
from mtplx_ext._checks import as_int, require_array

StreamLike = mx.Stream | mx.Device | None

#: Output columns per packed panel.
PANEL: int = int(_ext.PACKED_PANEL)


def pack_linear_weight(weight: mx.array, *, stream: StreamLike = None) -> mx.array:
    """A Linear weight [N, K] float32 as panels [ceil(N / 48), K, 48] (the last zero padded)."""
    return _ext.pack_linear_weight(require_array("weight", weight), stream=stream)


def unpack_linear_weight(w_packed: mx.array, n: int, *, stream: StreamLike = None) -> mx.array:
    """The inverse of `pack_linear_weight`: [P, K, 48] back to [n, K], bit for bit."""
    return _ext.unpack_linear_weight(require_array("w_packed", w_packed), as_int("n", n, lo=1, hi=2**31), stream=stream)


def packed_linear(x: mx.array, w_packed: mx.array, n: int, *, stream: StreamLike = None) -> mx.array:
    """`x @ W.T` for x [..., K] float32 and W [n, K] packed by `pack_linear_weight`.

    Raises:
        ValueError: a shape, dtype or `n` that does not match (naming the
            argument), or a GPU stream.
    """
    return _ext.packed_linear(
        require_array("x", x), require_array("w_packed", w_packed), as_int("n", n, lo=1, hi=2**31), stream=stream
    )


def packed_linear_isa() -> str:
    """The packed GEMM's instruction set on this CPU: "avx512", "avx2", "neon" or "generic"."""
    return str(_ext.packed_linear_isa())


def set_packed_linear_isa(isa: str) -> str:
    """Runs the packed GEMM's `isa` kernels ("avx512", "avx2", "generic"; "" restores this CPU's pick).

    For tests and benchmarks: every kernel must give the same bits (one FMA
    chain per output element), so a test runs each one this CPU can run.
    Returns the previous override ("" for none).

    Raises:
        ValueError: `isa` is unknown or this CPU cannot run it.
    """
    if not isinstance(isa, str):
        raise TypeError(f"isa must be a str, got {type(isa).__name__}")
    return str(_ext.set_packed_linear_isa(isa))


__all__ = [
    "PANEL",
    "pack_linear_weight",
    "packed_linear",
    "packed_linear_isa",
    "set_packed_linear_isa",
    "unpack_linear_weight",
]
