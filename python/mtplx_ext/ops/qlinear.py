"""Affine-quantized Linear weights repacked for the CPU's integer dot products.

MLX's CPU `quantized_matmul` dequantizes every weight to float and runs one
thread far below the FMA rate, so a quantized model decodes slower on the
CPU than the same model in float32. `pack_quantized_weight` repacks an
mlx-lm quantized weight once, at load time, into the layout of the
extension's quantized GEMM (`csrc/cpu/qgemm.h`: panels of 64 output columns,
q as unsigned bytes or nibbles grouped 4 input indices per 32-bit lane,
scales and biases per panel and group), and `packed_quantized_linear`
multiplies by it: activations are quantized per row and group to int8,
the group's dot products are exact integer sums (AMX-INT8 tiles for many
rows, AVX-512 VNNI, AVX2, or a generic kernel, all giving the same bits), and each group's scale and bias
are applied once per row and column.

Exactness: every row's result depends only on that row (a verification row
is bit for bit the plain step's row). Against the dequantized product in
float64 the only error is the activations' int8 rounding, at most
`sum_g |s| * d_g / 2 * sum_k q` per output (`d_g = max|x_g| / 127`).

MLX's bit layout of every width (2, 3, 4, 5, 6, 8) is one little-endian bit
stream per row (value j at bits [j * bits, (j + 1) * bits)), which is how
both directions here read and write it.
"""

from __future__ import annotations

import mlx.core as mx

from mtplx_ext import _ext
from mtplx_ext._checks import as_int, require_array

StreamLike = mx.Stream | mx.Device | None

#: Output columns per panel.
PANEL: int = int(_ext.QUANTIZED_PANEL)
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

#: Rows of a weight unpacked at a time (a multiple of PANEL): bounds the
#: temporary bit arrays of a large vocabulary's head.
_CHUNK_ROWS = 4096


def _step_k(bits: int) -> int:
    return 8 if bits <= 4 else 4


def _check_format(group_size: object, bits: object) -> tuple[int, int]:
    gs, b = as_int("group_size", group_size), as_int("bits", bits)
    if gs not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {gs}")
    if b not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {b}")
    return gs, b


def unpack_bits(words: mx.array, bits: int, k: int) -> mx.array:
    """MLX's packed uint32 rows [..., k * bits / 32] -> the values [..., k] as uint8."""
    shifts = mx.arange(32, dtype=mx.uint32)
    stream = ((words[..., None] >> shifts) & 1).astype(mx.uint8)
    per_value = stream.reshape(*words.shape[:-1], k, bits)
    return (per_value << mx.arange(bits, dtype=mx.uint8)).sum(axis=-1).astype(mx.uint8)


def pack_bits(q: mx.array, bits: int) -> mx.array:
    """The inverse of `unpack_bits`: values [..., k] (< 2^bits) -> uint32 words [..., k * bits / 32]."""
    k = q.shape[-1]
    stream = (q.astype(mx.uint32)[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1
    words = stream.reshape(*q.shape[:-1], k * bits // 32, 32)
    return (words << mx.arange(32, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def _pad_rows(a: mx.array, rows: int) -> mx.array:
    extra = rows - a.shape[0]
    return mx.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1)) if extra else a


def _pack_q(q: mx.array, group_size: int, bits: int) -> mx.array:
    """q [n, K] (n a multiple of PANEL) -> the weight stream [n / PANEL, G, steps * 256] uint8."""
    n, k = q.shape
    p, g, steps = n // PANEL, k // group_size, group_size // _step_k(bits)
    if bits <= 4:  # byte 4 l + t of a block: k = 8 s + t (low nibble), 8 s + 4 + t (high)
        q = q.reshape(p, 4, 16, g, steps, 2, 4).transpose(0, 3, 4, 1, 2, 6, 5)
        q = q[..., 0] | (q[..., 1] << 4)
    else:
        q = q.reshape(p, 4, 16, g, steps, 4).transpose(0, 3, 4, 1, 2, 5)
    return q.reshape(p, g, steps * 256)


def pack_quantized_weight(
    weight: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> tuple[mx.array, mx.array]:
    """An mlx-lm affine-quantized weight (as `mx.quantize` returns it) in the quantized GEMM's layout.

    Args:
        weight: uint32 [n, K * bits / 32].
        scales, biases: [n, K / group_size], float32 / float16 / bfloat16.

    Returns:
        (wq, sb): the weight stream [P, G, group_size / step * 256] uint8 and
        the scales and biases [P, G, 2, 64] in their own dtype, P = ceil(n / 64).

    Raises:
        TypeError / ValueError: naming the argument that does not fit.
    """
    weight, scales, biases = (require_array(n, a) for n, a in (("weight", weight), ("scales", scales), ("biases", biases)))
    gs, bits = _check_format(group_size, bits)
    if weight.dtype != mx.uint32 or weight.ndim != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
        raise ValueError(f"weight must be a 2-D uint32 array, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 32 // bits
    if (weight.shape[1] * 32) % bits or k % gs:
        raise ValueError(f"weight's {weight.shape[1]} words do not hold a whole number of groups of {gs} {bits}-bit values")
    for name, a in (("scales", scales), ("biases", biases)):
        if a.dtype not in SCALE_DTYPES or tuple(a.shape) != (n, k // gs):
            raise ValueError(f"{name} must be float32 / float16 / bfloat16 of shape {(n, k // gs)}, got {a.dtype} {tuple(a.shape)}")
    if biases.dtype != scales.dtype:
        raise ValueError(f"biases must have the dtype of scales ({scales.dtype}), got {biases.dtype}")
    p = -(-n // PANEL)
    chunks = []
    for r0 in range(0, n, _CHUNK_ROWS):
        q = unpack_bits(weight[r0 : r0 + _CHUNK_ROWS], bits, k)
        chunks.append(_pack_q(_pad_rows(q, -(-q.shape[0] // PANEL) * PANEL), gs, bits))
        mx.eval(chunks[-1])
    wq = mx.concatenate(chunks) if len(chunks) > 1 else chunks[0]
    sb = _pad_rows(mx.stack([scales, biases]).transpose(1, 0, 2), p * PANEL)  # [P * 64, 2, G]
    sb = sb.reshape(p, PANEL, 2, k // gs).transpose(0, 3, 2, 1)
    return mx.contiguous(wq), mx.contiguous(sb)


def unpack_quantized_rows(
    wq: mx.array, sb: mx.array, rows: mx.array, group_size: int, bits: int, n: int | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """Rows `rows` (any int shape) of a packed weight in mlx's format: (weight uint32, scales, biases).

    Reads only those rows (an embedding lookup); `unpack_quantized_weight`
    is every row. On a CPU default device with `n` (the weight's rows) it
    is one extension node (ids clamped to [0, n)); otherwise a graph of mlx
    ops (a GPU, or the reference the tests compare the node with).
    """
    if n is not None and mx.default_device() == mx.cpu:
        w, s, b = _ext.packed_quantized_rows(wq, sb, rows, as_int("n", n, lo=1, hi=2**31), group_size, bits)
        return w, s, b
    p, g, block = wq.shape
    steps = group_size // _step_k(bits)
    rows = rows.astype(mx.int32)
    panel, col = rows // PANEL, rows % PANEL
    # 4-byte units of the stream: ((panel G + g) steps + s) 64 + block 16 + lane
    units = wq.reshape(-1, 4)
    offs = mx.arange(g * steps, dtype=mx.int32) * 64
    base = panel * (g * steps * 64) + (col // 16) * 16 + col % 16
    b = units[base[..., None] + offs]  # [..., G * steps, 4]
    if bits <= 4:
        b = mx.stack([b & 15, b >> 4], axis=-2)  # k = 8 s + 4 h + t
    q = b.reshape(*rows.shape, g * group_size)
    sbf = sb.reshape(-1)
    gi = mx.arange(g, dtype=mx.int32)[None] * (2 * PANEL)
    at = (panel * (g * 2 * PANEL) + col)[..., None] + gi
    return pack_bits(q, bits), sbf[at], sbf[at + PANEL]


def packed_quantized_embedding(
    wq: mx.array, sb: mx.array, ids: mx.array, n: int, group_size: int, bits: int, *, stream: StreamLike = None
) -> mx.array:
    """Rows `ids` (any int shape) of a packed weight [n, K], dequantized: [..., K] in the scales' dtype.

    Bit for bit `mx.dequantize` of the rows in mlx's format, in one CPU
    node; ids are clamped to [0, n).

    Raises:
        ValueError: a shape, dtype, `n`, `group_size` or `bits` that does not
            match (naming the argument), or a GPU stream.
    """
    return _ext.packed_quantized_embedding(
        require_array("wq", wq), require_array("sb", sb), require_array("ids", ids),
        as_int("n", n, lo=1, hi=2**31), as_int("group_size", group_size), as_int("bits", bits), stream=stream,
    )


def unpack_quantized_weight(wq: mx.array, sb: mx.array, n: int, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """The inverse of `pack_quantized_weight`: (weight uint32, scales, biases), bit for bit.

    On a CPU default device one extension node (no bit-per-value temporaries
    for a large vocabulary's head).
    """
    n = as_int("n", n, lo=1, hi=2**31)
    return unpack_quantized_rows(wq, sb, mx.arange(n), group_size, bits, n)


def packed_quantized_linear(
    x: mx.array,
    wq: mx.array,
    sb: mx.array,
    n: int,
    group_size: int,
    bits: int,
    *,
    prefetch: tuple[mx.array, mx.array] | tuple[()] = (),
    stream: StreamLike = None,
) -> mx.array:
    """`x @ W.T` for x [..., K] and W [n, K] packed by `pack_quantized_weight`, on a CPU stream.

    The output dtype is mx.quantized_matmul's: x's and the scales' promoted.
    `prefetch`: the (wq, sb) of the packed weight multiplied next; once this
    product is done, the CPU thread pool's idle worker streams it toward the
    caches while the ops in between run. It changes no result.

    Raises:
        ValueError: a shape, dtype, `n`, `group_size`, `bits` or `prefetch`
            that does not match (naming the argument), or a GPU stream.
    """
    if not isinstance(prefetch, (tuple, list)):
        raise TypeError(f"prefetch must be a tuple (wq, sb) or (), got {type(prefetch).__name__}")
    return _ext.packed_quantized_linear(
        require_array("x", x),
        require_array("wq", wq),
        require_array("sb", sb),
        as_int("n", n, lo=1, hi=2**31),
        as_int("group_size", group_size),
        as_int("bits", bits),
        prefetch=[require_array("prefetch", a) for a in prefetch],
        stream=stream,
    )


def packed_quantized_linear_isa() -> str:
    """The quantized GEMM's instruction set here: "amx" (AMX-INT8 tiles for many rows), "avx512" (VNNI), "avx2" or "generic"."""
    return str(_ext.packed_quantized_linear_isa())


def set_packed_quantized_linear_isa(isa: str) -> str:
    """Runs the quantized GEMM's `isa` kernels ("" restores this CPU's pick); returns the previous override.

    For tests and benchmarks: every kernel must give the same bits.

    Raises:
        ValueError: `isa` is unknown or this CPU cannot run it.
    """
    if not isinstance(isa, str):
        raise TypeError(f"isa must be a str, got {type(isa).__name__}")
    return str(_ext.set_packed_quantized_linear_isa(isa))


__all__ = [
    "PANEL",
    "pack_bits",
    "pack_quantized_weight",
    "packed_quantized_embedding",
    "packed_quantized_linear",
    "packed_quantized_linear_isa",
    "set_packed_quantized_linear_isa",
    "unpack_bits",
    "unpack_quantized_rows",
    "unpack_quantized_weight",
]
