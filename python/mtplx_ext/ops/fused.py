"""Single-node CPU forms of MLX's fast RMSNorm, RoPE and attention ops and of
mlx-lm's SwiGLU.

On MLX's CPU backend `mx.fast.rms_norm`, `mx.fast.rope` and
`mx.fast.scaled_dot_product_attention` expand into their composed fallback
graphs (about 8, 20 and 15 nodes each). In a small decode forward most of the
time then goes to per-node scheduling rather than math. mlx-lm's compiled
`swiglu` becomes one node, but a scalar loop calling libm per element. The
ops here compute the same results in one vectorised graph node each on a CPU
stream; on a GPU stream they call `mx.fast` (or, for swiglu, the composed
ops) itself, whose Metal kernels are already fused. Gradients go through
`mx.fast`'s differentiable fallback, so training through fused modules works.

The modules that call these ops and the mlx-lm routing live a layer up:
`mtplx_ext.models.fused_modules` (`fuse_cpu_ops`) and
`mtplx_ext.models.mlx_lm_patches` (`patch_mlx_lm_ops`).
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from mtplx_ext import _ext
from mtplx_ext._checks import LOGIT_DTYPES, as_int, is_int, require_array

StreamLike = mx.Stream | mx.Device | None

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _require_float(name: str, value: object) -> mx.array:
    a = require_array(name, value)
    if a.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {a.dtype}")
    return a


def _check_mask(mask: object) -> None:
    """An attention mask argument: None, "causal" or an mx.array."""
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f'mask must be None, "causal" or an mx.array, got {mask!r}')
    elif mask is not None and not isinstance(mask, mx.array):
        raise TypeError(f'mask must be None, "causal" or an mx.array, got {type(mask).__name__}')


def _require_number(name: str, value: object) -> float:
    # NumPy scalars too (np.float32 is no Python float); bools are no numbers.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def rms_norm(
    x: mx.array,
    weight: mx.array | None,
    eps: float,
    *,
    stream: StreamLike = None,
) -> mx.array:
    """Root-mean-square normalisation of the last axis, as `mx.fast.rms_norm`.

    Computes `x / sqrt(mean(x**2) + eps)` with the mean in float32, casts it
    to the output dtype and multiplies by `weight` in that dtype (the rounding
    steps of `mx.fast.rms_norm`).

    Args:
        x: [..., D] float32/float16/bfloat16 array (any strides).
        weight: [D] float array, or None for no scale.
        eps: small constant added to the mean square, >= 0.
        stream: MLX stream or device (default: the default stream).

    Returns:
        Array of x's shape, row contiguous; dtype of x (promoted with weight's).

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: weight's shape does not match x's last axis, or eps < 0.
    """
    x = _require_float("x", x)
    if weight is not None:
        weight = _require_float("weight", weight)
    eps = _require_number("eps", eps)
    return _ext.rms_norm(x, weight, eps, stream=stream)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float,
    scale: float,
    offset: int | mx.array,
    stream: StreamLike = None,
) -> mx.array:
    """Rotary positional embedding, as `mx.fast.rope` with a scalar base.

    Feature pairs of the first `dims` features are rotated by
    theta_i = (offset + t) * scale * base**(-i / (dims / 2)) at sequence
    position t (axis -2); the other features pass through.

    Args:
        x: [B, ..., T, D] float32/float16/bfloat16 array (e.g. mlx-lm's
            [B, n_heads, L, head_dim]), any strides.
        dims: number of leading features to rotate; even, <= D.
        traditional: rotate consecutive pairs (2i, 2i + 1) instead of
            (i, i + dims / 2).
        base: frequency base, > 0.
        scale: factor on the positions.
        offset: position of x's first row: an int, or an integer mx.array of
            size 1 or B (one per batch entry, as mlx-lm's BatchKVCache).
        stream: MLX stream or device (default: the default stream).

    Returns:
        Array of x's shape and dtype, row contiguous.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: bad shapes, dims or base.
    """
    x = _require_float("x", x)
    dims = as_int("dims", dims)
    if not isinstance(traditional, bool):
        raise TypeError(f"traditional must be a bool, got {type(traditional).__name__}")
    base = _require_number("base", base)
    scale = _require_number("scale", scale)
    if isinstance(offset, mx.array):
        if not mx.issubdtype(offset.dtype, mx.integer):
            raise TypeError(f"offset must have an integer dtype, got {offset.dtype}")
    elif not is_int(offset):
        raise TypeError(f"offset must be an int or an mx.array, got {type(offset).__name__}")
    elif not _INT32_MIN <= offset <= _INT32_MAX:
        raise ValueError(f"offset must fit in int32, got {offset}")
    else:
        offset = int(offset)
    return _ext.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset, stream=stream
    )


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
    stream: StreamLike = None,
) -> mx.array:
    """softmax(scale * q @ k.T + mask) @ v per head, as the `mx.fast` op.

    Grouped-query attention: query head h reads kv head h // (Hq // Hkv).
    The softmax runs in float32 with the row maximum subtracted. As in
    `mx.fast`: a row whose keys are all masked by a bool or causal mask
    averages the values uniformly; a row whose scores are all -inf under an
    additive mask (or hold NaN) comes out NaN.

    Args:
        queries: [B, Hq, T, D] float32/float16/bfloat16 array (any strides).
        keys: [B, Hkv, S, D], Hq a multiple of Hkv.
        values: [B, Hkv, S, Dv].
        scale: factor on the scores, usually D ** -0.5.
        mask: None; "causal" (query t sees keys s <= t + S - T); a bool array
            broadcastable to [B, Hq, T, S] (True = attend); or an additive
            array of a dtype that promotes to the attention dtype.
        stream: MLX stream or device (default: the default stream).

    Returns:
        [B, Hq, T, Dv] array of the promoted q/k/v dtype, row contiguous.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: shapes do not fit together, or a bad mask.
    """
    queries = _require_float("queries", queries)
    keys = _require_float("keys", keys)
    values = _require_float("values", values)
    scale = _require_number("scale", scale)
    _check_mask(mask)
    return _ext.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, stream=stream
    )


def _quantized_triple(name: str, value: object) -> tuple[mx.array, mx.array, mx.array]:
    if not (isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(a, mx.array) for a in value)):
        raise TypeError(f"{name} must be a (packed, scales, biases) tuple of mx.array (mx.quantize's output)")
    return value[0], value[1], value[2]


def quantized_scaled_dot_product_attention(
    queries: mx.array,
    keys: tuple[mx.array, mx.array, mx.array],
    values: tuple[mx.array, mx.array, mx.array],
    *,
    scale: float,
    bits: int,
    group_size: int,
    mask: mx.array | str | None = None,
    stream: StreamLike = None,
) -> mx.array:
    """`scaled_dot_product_attention` over keys and values quantized as mlx-lm's `QuantizedKVCache` stores them.

    The CPU kernel reads the packed KV as it is (no dequantized copy of the
    cache): each key and value row is dequantized as `scale * q + bias` in
    float32 once per call, whatever the number of query rows sharing its kv
    head, then the softmax, masks and NaN rows are those of
    `scaled_dot_product_attention`. A query row's result does not depend on
    the other rows of the call. On a GPU stream: `mx.dequantize` and the
    `mx.fast` op.

    Args:
        queries: [B, Hq, T, D] float32/float16/bfloat16.
        keys: (packed uint32 [B, Hkv, S, D * bits / 32], scales, biases
            [B, Hkv, S, D / group_size]) as `mx.quantize(k, group_size, bits)`.
        values: the same for [B, Hkv, S, Dv].
        scale: factor on the scores.
        bits: 2, 3, 4, 5, 6 or 8.
        group_size: 32, 64 or 128.
        mask: as for `scaled_dot_product_attention`.
        stream: MLX stream or device.

    Returns:
        [B, Hq, T, Dv] in the promotion of the queries' and scales' dtypes.

    Raises:
        TypeError / ValueError: naming the bad argument.
    """
    queries = _require_float("queries", queries)
    k = _quantized_triple("keys", keys)
    v = _quantized_triple("values", values)
    scale = _require_number("scale", scale)
    bits = as_int("bits", bits)
    group_size = as_int("group_size", group_size)
    _check_mask(mask)
    return _ext.quantized_scaled_dot_product_attention(
        queries, k, v, scale=scale, bits=bits, group_size=group_size, mask=mask, stream=stream
    )


def swiglu(gate: mx.array, x: mx.array, *, stream: StreamLike = None) -> mx.array:
    """silu(gate) * x, as mlx-lm's `swiglu` (the SwiGLU MLPs' activation).

    Computes gate * sigmoid(gate) * x in float32, rounding to the output
    dtype after each of the three ops as the composed graph does.

    Args:
        gate: float32/float16/bfloat16 array (any strides), at least 1-D.
        x: array of gate's shape.
        stream: MLX stream or device (default: the default stream).

    Returns:
        Array of their shape and promoted dtype, row contiguous.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: the shapes differ, or gate is a scalar.
    """
    gate = _require_float("gate", gate)
    x = _require_float("x", x)
    return _ext.swiglu(gate, x, stream=stream)


__all__ = ["rms_norm", "rope", "scaled_dot_product_attention", "swiglu"]
