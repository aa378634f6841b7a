// Fused CPU forms of mx.fast.rms_norm, mx.fast.rope,
// mx.fast.scaled_dot_product_attention and mlx-lm's swiglu: same semantics,
// one graph node each on a CPU stream. On a GPU stream they return the mx::fast
// op (or, for swiglu, the composed ops, which MLX fuses) itself: MLX's Metal
// kernels are already fused. Arguments are checked before any kernel
// runs; std::invalid_argument names the bad argument.
#pragma once

#include <optional>
#include <string>
#include <variant>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mtplx {

namespace mx = mlx::core;

// x [..., D] normalised over its last axis: x / sqrt(mean(x^2) + eps) in
// float32, cast to the output dtype, then times weight [D] (if any) in that
// dtype, exactly as mx::fast::rms_norm's fallback. Output dtype: x's, or its
// promotion with weight's.
mx::array rms_norm(
    const mx::array& x,
    const std::optional<mx::array>& weight,
    float eps,
    mx::StreamOrDevice s = {});

// Rotary embedding of the first `dims` features of x [B, ..., T, D] at
// positions (offset + t) * scale, t < T, with inverse frequencies
// base^(-i / (dims / 2)). offset: a Python-style int or an integer array of
// size 1 or B (one start position per batch entry).
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const std::variant<int, mx::array>& offset,
    mx::StreamOrDevice s = {});

// softmax(scale * q k^T + mask) v per head; q [B, Hq, T, D], k [B, Hkv, S, D],
// v [B, Hkv, S, Dv], Hq a multiple of Hkv (grouped-query attention).
// mask_mode "" (then `mask` may hold an array: bool keeps where true,
// otherwise additive) or "causal" (bottom-right aligned, no array). Softmax
// runs in float32 with the row maximum subtracted. As in mx::fast: a row
// whose keys are all masked by a bool or causal mask averages v uniformly; a
// row whose scores are all -inf (additive mask), or hold NaN, is NaN.
mx::array scaled_dot_product_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    float scale,
    const std::string& mask_mode,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s = {});

// Keys or values in MLX's affine quantized layout (mx.quantize along the
// head dimension, mlx-lm's QuantizedKVCache): packed uint32 [B, Hkv, S,
// D * bits / 32], scales and biases [B, Hkv, S, D / group_size].
struct QuantizedKV {
  mx::array packed, scales, biases;
};

// scaled_dot_product_attention over quantized keys and values, read as
// they are stored (no dequantized copy on a CPU stream): the softmax, masks
// and NaN rows as there, each key and value row dequantized as
// scale * q + bias in float32. bits 2, 3, 4, 5, 6 or 8; group_size 32, 64
// or 128. Output: [B, Hq, T, Dv] in the promotion of the queries' and the
// scales' dtypes. On a GPU stream: mx::dequantize and the mx::fast op.
mx::array quantized_scaled_dot_product_attention(
    const mx::array& queries,
    const QuantizedKV& keys,
    const QuantizedKV& values,
    float scale,
    int bits,
    int group_size,
    const std::string& mask_mode,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s = {});

// silu(gate) * x = gate * sigmoid(gate) * x, as mlx-lm's `swiglu`: float32
// math, rounded to the output dtype after each op. gate and x must have the
// same shape; the output dtype is their promotion.
mx::array swiglu(
    const mx::array& gate,
    const mx::array& x,
    mx::StreamOrDevice s = {});

} // namespace mtplx
