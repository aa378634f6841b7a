#include <cmath>
#include <string>

#include "arg_checks.h"
#include "attention_args.h"
#include "fused_ops.h"
#include "fused_primitives.h"
#include "mlx/fast.h"
#include "mlx/ops.h"

namespace mtplx {

namespace {

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// Checks one quantized tensor (packed, scales, biases) named `name` against
// [B, Hkv, S, *]; returns its dequantized row length.
int check_packed(
    const char* name,
    const QuantizedKV& t,
    int B,
    int Hkv,
    int S,
    int bits,
    int group_size) {
  const std::string n(name);
  const mx::array* parts[3] = {&t.packed, &t.scales, &t.biases};
  const char* what[3] = {"packed", "scales", "biases"};
  for (int i = 0; i < 3; ++i) {
    const mx::array& a = *parts[i];
    if (a.ndim() != 4 || a.shape(0) != B || a.shape(1) != Hkv ||
        a.shape(2) != S) {
      bad_arg(
          n + ": the " + what[i] + " must have shape [B, Hkv, S, *] = (" +
          std::to_string(B) + ", " + std::to_string(Hkv) + ", " +
          std::to_string(S) + ", *), got " + shape_str(a.shape()));
    }
  }
  if (t.packed.dtype() != mx::uint32) {
    bad_arg(n + ": the packed part must be uint32 (mx.quantize's output)");
  }
  if (!is_float(t.scales.dtype()) || t.biases.dtype() != t.scales.dtype()) {
    bad_arg(
        n + ": scales and biases must share one float dtype "
            "(float32, float16 or bfloat16)");
  }
  if (t.scales.shape(3) != t.biases.shape(3) || t.scales.shape(3) < 1) {
    bad_arg(
        n + ": scales and biases must have the same number of groups, got " +
        shape_str(t.scales.shape()) + " and " + shape_str(t.biases.shape()));
  }
  const int64_t width = int64_t(t.scales.shape(3)) * group_size;
  if (width * bits != int64_t(t.packed.shape(3)) * 32) {
    bad_arg(
        n + ": " + std::to_string(t.packed.shape(3)) + " packed words of " +
        std::to_string(bits) + "-bit values do not hold " +
        std::to_string(t.scales.shape(3)) + " groups of " +
        std::to_string(group_size));
  }
  return int(width);
}

} // namespace

mx::array quantized_scaled_dot_product_attention(
    const mx::array& queries,
    const QuantizedKV& keys,
    const QuantizedKV& values,
    float scale,
    int bits,
    int group_size,
    const std::string& mask_mode,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 &&
      bits != 8) {
    bad_arg("bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    bad_arg(
        "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (queries.ndim() != 4) {
    bad_arg(
        "queries must have 4 dimensions [B, Hq, T, D], got shape " +
        shape_str(queries.shape()));
  }
  if (!is_float(queries.dtype())) {
    bad_arg("queries must be float32, float16 or bfloat16");
  }
  if (!std::isfinite(scale)) {
    bad_arg("scale must be finite");
  }
  const int B = queries.shape(0), Hq = queries.shape(1);
  const int T = queries.shape(2), D = queries.shape(3);
  if (keys.packed.ndim() != 4) {
    bad_arg(
        "keys: the packed part must have 4 dimensions [B, Hkv, S, words], "
        "got shape " +
        shape_str(keys.packed.shape()));
  }
  const int Hkv = keys.packed.shape(1), S = keys.packed.shape(2);
  check_kv_heads(Hq, Hkv, S);
  const int Dk = check_packed("keys", keys, B, Hkv, S, bits, group_size);
  if (Dk != D) {
    bad_arg(
        "keys dequantize to rows of " + std::to_string(Dk) +
        ", the queries have D = " + std::to_string(D));
  }
  const int Dv = check_packed("values", values, B, Hkv, S, bits, group_size);
  if (keys.scales.dtype() != values.scales.dtype()) {
    bad_arg("keys and values must have scales of one dtype");
  }
  const mx::Dtype final_type =
      mx::promote_types(queries.dtype(), keys.scales.dtype());
  auto [kind, m] =
      check_attention_mask(mask_mode, mask, B, Hq, T, S, final_type);

  auto st = mx::to_stream(s);
  if (st.device.type == mx::Device::gpu) {
    auto deq = [&](const QuantizedKV& t) {
      return mx::astype(
          mx::dequantize(
              t.packed, t.scales, t.biases, group_size, bits, "affine",
              std::nullopt, std::nullopt, st),
          final_type, st);
    };
    return mx::fast::scaled_dot_product_attention(
        mx::astype(queries, final_type, st), deq(keys), deq(values), scale,
        mask_mode, m, {}, false, st);
  }
  std::vector<mx::array> inputs = {
      mx::astype(queries, final_type, st),
      keys.packed,
      keys.scales,
      keys.biases,
      values.packed,
      values.scales,
      values.biases};
  if (m) {
    inputs.push_back(
        m->dtype() == mx::bool_ ? *m : mx::astype(*m, final_type, st));
  }
  return mx::array(
      {B, Hq, T, Dv},
      final_type,
      std::make_shared<FusedQuantizedAttention>(
          st, scale, kind, bits, group_size),
      std::move(inputs));
}

void FusedQuantizedAttention::eval_gpu(
    const std::vector<mx::array>&,
    mx::array&) {
  throw std::runtime_error(
      "FusedQuantizedAttention has no GPU kernel: "
      "quantized_scaled_dot_product_attention dequantizes for GPU streams");
}

bool FusedQuantizedAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FusedQuantizedAttention&>(other);
  return scale_ == o.scale_ && mask_ == o.mask_ && bits_ == o.bits_ &&
      group_size_ == o.group_size_;
}

std::vector<mx::Shape> FusedQuantizedAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  auto& q = inputs[0];
  return {{q.shape(0), q.shape(1), q.shape(2),
           inputs[5].shape(3) * group_size_}};
}

} // namespace mtplx
