#include "fused_ops.h"

#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

#include "arg_checks.h"
#include "attention_args.h"
#include "fused_primitives.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"

namespace mtplx {

namespace {

void check_float_array(const char* name, const mx::array& a) {
  if (!is_logit_dtype(a.dtype())) {
    bad_arg(std::string(name) + " must be float32, float16 or bfloat16");
  }
}

std::string num_str(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// Keeps the arrays at `argnums` (in order).
std::vector<mx::array> pick(
    const std::vector<mx::array>& all,
    const std::vector<int>& argnums) {
  std::vector<mx::array> out;
  out.reserve(argnums.size());
  for (int i : argnums) {
    out.push_back(all[i]);
  }
  return out;
}

// Tangents for every primal: the given ones at argnums, zeros elsewhere.
std::vector<mx::array> full_tangents(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums,
    mx::Stream s) {
  std::vector<mx::array> out;
  for (size_t i = 0, j = 0; i < primals.size(); ++i) {
    if (j < argnums.size() && argnums[j] == int(i)) {
      out.push_back(tangents[j++]);
    } else {
      out.push_back(mx::zeros_like(primals[i], s));
    }
  }
  return out;
}

} // namespace

std::vector<mx::array> ReferenceDifferentiable::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto [_, vjps] = mx::vjp(reference(), primals, cotangents);
  return pick(vjps, argnums);
}

std::vector<mx::array> ReferenceDifferentiable::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto [_, jvps] = mx::jvp(
      reference(),
      primals,
      full_tangents(primals, tangents, argnums, stream()));
  return jvps;
}

// ---------------------------------------------------------------------------
// rms_norm

mx::array rms_norm(
    const mx::array& x,
    const std::optional<mx::array>& weight,
    float eps,
    mx::StreamOrDevice s) {
  if (x.ndim() < 1) {
    bad_arg("x must have at least 1 dimension, got a scalar");
  }
  check_float_array("x", x);
  if (weight) {
    if (weight->ndim() != 1 || weight->shape(0) != x.shape(-1)) {
      bad_arg(
          "weight must have shape (" + std::to_string(x.shape(-1)) +
          ",) to match the last axis of x, got " + shape_str(weight->shape()));
    }
    check_float_array("weight", *weight);
  }
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    bad_arg("eps must be finite and >= 0, got " + num_str(eps));
  }
  auto st = mx::to_stream(s);
  if (st.device.type == mx::Device::gpu) {
    return mx::fast::rms_norm(x, weight, eps, st);
  }
  auto out_type =
      weight ? mx::promote_types(x.dtype(), weight->dtype()) : x.dtype();
  std::vector<mx::array> inputs = {mx::astype(x, out_type, st)};
  if (weight) {
    inputs.push_back(mx::astype(*weight, out_type, st));
  }
  return mx::array(
      x.shape(),
      out_type,
      std::make_shared<FusedRMSNorm>(st, eps, weight.has_value()),
      std::move(inputs));
}

void FusedRMSNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "FusedRMSNorm has no GPU kernel: rms_norm sends GPU streams to "
      "mx.fast.rms_norm");
}

bool FusedRMSNorm::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FusedRMSNorm&>(other);
  return eps_ == o.eps_ && has_weight_ == o.has_weight_;
}

std::vector<mx::Shape> FusedRMSNorm::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

namespace {

std::function<std::vector<mx::array>(const std::vector<mx::array>&)>
rms_norm_reference(float eps, bool has_weight, mx::Stream s) {
  return [eps, has_weight, s](const std::vector<mx::array>& in) {
    std::optional<mx::array> w;
    if (has_weight) {
      w = in[1];
    }
    return std::vector<mx::array>{mx::fast::rms_norm(in[0], w, eps, s)};
  };
}

} // namespace

ReferenceFn FusedRMSNorm::reference() {
  return rms_norm_reference(eps_, has_weight_, stream());
}

// ---------------------------------------------------------------------------
// rope

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const std::variant<int, mx::array>& offset,
    mx::StreamOrDevice s) {
  if (x.ndim() < 3) {
    bad_arg(
        "x must have at least 3 dimensions [B, ..., T, D], got shape " +
        shape_str(x.shape()));
  }
  check_float_array("x", x);
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    bad_arg(
        "dims must be even and in [2, D = " + std::to_string(x.shape(-1)) +
        "], got " + std::to_string(dims));
  }
  if (!(base > 0.0f) || !std::isfinite(base)) {
    bad_arg("base must be finite and > 0, got " + num_str(base));
  }
  if (!std::isfinite(scale)) {
    bad_arg("scale must be finite, got " + num_str(scale));
  }
  auto st = mx::to_stream(s);
  mx::array off = std::holds_alternative<int>(offset)
      ? mx::array(std::get<int>(offset), mx::int32)
      : std::get<mx::array>(offset);
  if (std::holds_alternative<mx::array>(offset)) {
    if (!mx::issubdtype(off.dtype(), mx::integer)) {
      bad_arg("offset must be an int or an integer array");
    }
    if (off.ndim() > 1 ||
        (off.size() != 1 && off.size() != size_t(x.shape(0)))) {
      bad_arg(
          "offset must be a scalar or have shape (" +
          std::to_string(x.shape(0)) + ",) (one per batch entry of x), got " +
          shape_str(off.shape()));
    }
  }
  if (st.device.type == mx::Device::gpu) {
    return mx::fast::rope(
        x, dims, traditional, base, scale, off, std::nullopt, st);
  }
  if (off.dtype() != mx::int32) {
    off = mx::astype(off, mx::int32, st);
  }
  return mx::array(
      x.shape(),
      x.dtype(),
      std::make_shared<FusedRoPE>(st, dims, traditional, base, scale),
      {x, off});
}

void FusedRoPE::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "FusedRoPE has no GPU kernel: rope sends GPU streams to mx.fast.rope");
}

bool FusedRoPE::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FusedRoPE&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ &&
      base_ == o.base_ && scale_ == o.scale_;
}

std::vector<mx::Shape> FusedRoPE::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

namespace {

// mx::fast::rope of the primal x at the (captured) offset.
std::function<std::vector<mx::array>(const std::vector<mx::array>&)>
rope_reference(const FusedRoPE& p, const mx::array& offset, mx::Stream s) {
  return [dims = p.dims(),
          traditional = p.traditional(),
          base = p.base(),
          scale = p.scale(),
          offset,
          s](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{mx::fast::rope(
        in[0], dims, traditional, base, scale, offset, std::nullopt, s)};
  };
}

void check_rope_argnums(const std::vector<int>& argnums) {
  for (int a : argnums) {
    if (a != 0) {
      throw std::invalid_argument(
          "rope: derivatives with respect to offset are not defined");
    }
  }
}

} // namespace

std::vector<mx::array> FusedRoPE::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  check_rope_argnums(argnums);
  auto fn = rope_reference(*this, primals[1], stream());
  auto [_, vjps] = mx::vjp(fn, {primals[0]}, cotangents);
  return vjps;
}

std::vector<mx::array> FusedRoPE::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  check_rope_argnums(argnums);
  auto fn = rope_reference(*this, primals[1], stream());
  auto [_, jvps] = mx::jvp(fn, {primals[0]}, tangents);
  return jvps;
}

// ---------------------------------------------------------------------------
// scaled_dot_product_attention

mx::array scaled_dot_product_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    float scale,
    const std::string& mask_mode,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s) {
  const char* names[3] = {"queries", "keys", "values"};
  const mx::array* qkv[3] = {&queries, &keys, &values};
  for (int i = 0; i < 3; ++i) {
    if (qkv[i]->ndim() != 4) {
      bad_arg(
          std::string(names[i]) + " must have 4 dimensions [B, heads, " +
          (i == 0 ? "T" : "S") + ", D], got shape " +
          shape_str(qkv[i]->shape()));
    }
    check_float_array(names[i], *qkv[i]);
  }
  const int B = queries.shape(0), Hq = queries.shape(1);
  const int T = queries.shape(2), D = queries.shape(3);
  const int Hkv = keys.shape(1), S = keys.shape(2);
  if (keys.shape(0) != B || keys.shape(3) != D) {
    bad_arg(
        "keys must have shape [B, Hkv, S, D] with B = " + std::to_string(B) +
        " and D = " + std::to_string(D) + " from queries, got " +
        shape_str(keys.shape()));
  }
  if (values.shape(0) != B || values.shape(1) != Hkv || values.shape(2) != S) {
    bad_arg(
        "values must have shape [B, Hkv, S, Dv] = (" + std::to_string(B) +
        ", " + std::to_string(Hkv) + ", " + std::to_string(S) +
        ", Dv) to match keys, got " + shape_str(values.shape()));
  }
  check_kv_heads(Hq, Hkv, S);
  if (!std::isfinite(scale)) {
    bad_arg("scale must be finite, got " + num_str(scale));
  }
  auto final_type = mx::promote_types(
      mx::promote_types(queries.dtype(), keys.dtype()), values.dtype());
  auto [kind, m] =
      check_attention_mask(mask_mode, mask, B, Hq, T, S, final_type);
  auto st = mx::to_stream(s);
  if (st.device.type == mx::Device::gpu) {
    return mx::fast::scaled_dot_product_attention(
        queries, keys, values, scale, mask_mode, m, {}, false, st);
  }
  std::vector<mx::array> inputs = {
      mx::astype(queries, final_type, st),
      mx::astype(keys, final_type, st),
      mx::astype(values, final_type, st)};
  if (m) {
    inputs.push_back(
        m->dtype() == mx::bool_ ? *m : mx::astype(*m, final_type, st));
  }
  return mx::array(
      {B, Hq, T, values.shape(3)},
      final_type,
      std::make_shared<FusedAttention>(st, scale, kind),
      std::move(inputs));
}

void FusedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "FusedAttention has no GPU kernel: scaled_dot_product_attention sends "
      "GPU streams to mx.fast.scaled_dot_product_attention");
}

bool FusedAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FusedAttention&>(other);
  return scale_ == o.scale_ && mask_ == o.mask_;
}

std::vector<mx::Shape> FusedAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  auto& q = inputs[0];
  return {{q.shape(0), q.shape(1), q.shape(2), inputs[2].shape(3)}};
}

namespace {

// mx::fast::scaled_dot_product_attention over q, k, v (and a float mask when
// differentiable); a bool mask is captured as a constant.
struct AttentionReference {
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> fn;
  std::vector<mx::array> diff_primals;
};

AttentionReference attention_reference(
    const FusedAttention& p,
    const std::vector<mx::array>& primals,
    mx::Stream s) {
  const bool has_mask = primals.size() > 3;
  const bool float_mask = has_mask && primals[3].dtype() != mx::bool_;
  std::optional<mx::array> fixed_mask;
  if (has_mask && !float_mask) {
    fixed_mask = primals[3];
  }
  std::string mode = p.mask() == AttentionMask::kCausal ? "causal" : "";
  AttentionReference r;
  r.fn = [scale = p.scale(), mode, float_mask, fixed_mask, s](
             const std::vector<mx::array>& in) {
    std::optional<mx::array> m = float_mask ? std::optional(in[3]) : fixed_mask;
    return std::vector<mx::array>{mx::fast::scaled_dot_product_attention(
        in[0], in[1], in[2], scale, mode, m, {}, false, s)};
  };
  r.diff_primals = {primals[0], primals[1], primals[2]};
  if (float_mask) {
    r.diff_primals.push_back(primals[3]);
  }
  return r;
}

} // namespace

std::vector<mx::array> FusedAttention::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto ref = attention_reference(*this, primals, stream());
  auto [_, vjps] = mx::vjp(ref.fn, ref.diff_primals, cotangents);
  std::vector<mx::array> out;
  for (int a : argnums) {
    out.push_back(
        a < int(vjps.size()) ? vjps[a] : mx::zeros_like(primals[a], stream()));
  }
  return out;
}

std::vector<mx::array> FusedAttention::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  auto ref = attention_reference(*this, primals, stream());
  std::vector<int> used;
  std::vector<mx::array> used_tangents;
  for (size_t j = 0; j < argnums.size(); ++j) {
    if (argnums[j] < int(ref.diff_primals.size())) {
      used.push_back(argnums[j]);
      used_tangents.push_back(tangents[j]);
    }
  }
  auto [_, jvps] = mx::jvp(
      ref.fn,
      ref.diff_primals,
      full_tangents(ref.diff_primals, used_tangents, used, stream()));
  return jvps;
}

// ---------------------------------------------------------------------------
// swiglu

namespace {

mx::array swiglu_composed(const mx::array& gate, const mx::array& x, mx::Stream s) {
  return mx::multiply(mx::multiply(gate, mx::sigmoid(gate, s), s), x, s);
}

ReferenceFn swiglu_reference(mx::Stream s) {
  return [s](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{swiglu_composed(in[0], in[1], s)};
  };
}

} // namespace

mx::array swiglu(const mx::array& gate, const mx::array& x, mx::StreamOrDevice s) {
  check_float_array("gate", gate);
  check_float_array("x", x);
  if (gate.shape() != x.shape()) {
    bad_arg(
        "gate and x must have the same shape, got " + shape_str(gate.shape()) +
        " and " + shape_str(x.shape()));
  }
  if (gate.ndim() < 1) {
    bad_arg("gate must have at least 1 dimension, got a scalar");
  }
  auto st = mx::to_stream(s);
  if (st.device.type == mx::Device::gpu) {
    return swiglu_composed(gate, x, st);
  }
  auto out_type = mx::promote_types(gate.dtype(), x.dtype());
  return mx::array(
      gate.shape(),
      out_type,
      std::make_shared<FusedSwiGLU>(st),
      {mx::astype(gate, out_type, st), mx::astype(x, out_type, st)});
}

void FusedSwiGLU::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "FusedSwiGLU has no GPU kernel: swiglu sends GPU streams to the "
      "composed ops");
}

ReferenceFn FusedSwiGLU::reference() {
  return swiglu_reference(stream());
}

} // namespace mtplx
