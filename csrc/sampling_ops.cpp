#include "sampling_ops.h"

#include <string>

#include "arg_checks.h"
#include "cpu/thread_pool.h"
#include "mlx/ops.h"
#include "mtplx_rules.h"
#include "sampling_primitives.h"

namespace mtplx {

namespace {

void require_shape(
    const char* name,
    const mx::array& a,
    const mx::Shape& want,
    const char* want_str) {
  if (a.shape() != want) {
    bad_arg(
        std::string(name) + " must have shape " + want_str + " = " +
        shape_str(want) + ", got " + shape_str(a.shape()));
  }
}

mx::array float_input(const char* name, const mx::array& a, mx::Stream st) {
  if (!mx::issubdtype(a.dtype(), mx::floating)) {
    bad_arg(std::string(name) + " must be a floating array");
  }
  auto t = a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, st);
  return mx::contiguous(t, false, st);
}

// Counts travel as int32. Wider counts are clipped into [0, 2**31 - 1]
// first: a cast alone would wrap 2**31 to a negative count, which turns the
// penalties off (the kernels treat negative counts as 0 and saturate).
mx::array counts_input(const mx::array& a, int B, int V, mx::Stream st) {
  require_shape("token_counts", a, {B, V}, "[B, V]");
  if (!mx::issubdtype(a.dtype(), mx::integer)) {
    bad_arg("token_counts must have an integer dtype");
  }
  mx::array t = a;
  if (a.dtype() == mx::int64) {
    t = mx::clip(
        a,
        mx::array(int64_t(0), mx::int64),
        mx::array(int64_t(kMaxCount), mx::int64),
        st);
  } else if (a.dtype() == mx::uint32 || a.dtype() == mx::uint64) {
    t = mx::minimum(a, mx::array(kMaxCount, a.dtype()), st);
  }
  if (t.dtype() != mx::int32) {
    t = mx::astype(t, mx::int32, st);
  }
  return mx::contiguous(t, false, st);
}

// A bad MTPLX_CPU_THREADS fails here, where it can raise, rather than in
// the kernel (which then runs on one thread).
void check_cpu_threads(const mx::Stream& st) {
  if (st.device == mx::Device::cpu) {
    cpu::cpu_threads();
  }
}

// The draft logits of a sampled verification: `want` ([B, V] or
// [B, K, V]) and the dtype of verify_logits.
void check_draft_logits(
    const mx::array& draft_logits,
    const mx::array& verify_logits,
    const mx::Shape& want,
    const char* want_str) {
  require_shape("draft_logits", draft_logits, want, want_str);
  if (draft_logits.dtype() != verify_logits.dtype()) {
    bad_arg("draft_logits must have the dtype of verify_logits");
  }
}

// The primitive inputs of a sampled verification (checked arguments):
// verify_logits, draft_logits, tokens, uniforms, params[, counts].
std::vector<mx::array> verify_inputs(
    const mx::array& verify_logits,
    const mx::array& draft_logits,
    const mx::array& tokens,
    const mx::array& uniforms,
    const mx::array& params,
    const std::optional<mx::array>& token_counts,
    mx::Stream st) {
  const int B = verify_logits.shape(0);
  const int V = verify_logits.shape(2);
  check_cpu_threads(st);
  std::vector<mx::array> inputs = {
      mx::contiguous(verify_logits, false, st),
      mx::contiguous(draft_logits, false, st),
      token_ids("tokens", tokens, st),
      float_input("uniforms", uniforms, st),
      float_input("params", params, st)};
  if (token_counts) {
    inputs.push_back(counts_input(*token_counts, B, V, st));
  }
  return inputs;
}

} // namespace

mx::array sample_tokens(
    const mx::array& logits,
    const mx::array& uniforms,
    const mx::array& params,
    const std::optional<mx::array>& token_counts,
    const std::optional<mx::array>& extra_tokens,
    const std::optional<mx::array>& logit_bias_ids,
    const std::optional<mx::array>& logit_bias_values,
    mx::StreamOrDevice s) {
  if (logits.ndim() != 2) {
    bad_arg("logits must have shape [B, V], got " + shape_str(logits.shape()));
  }
  if (!is_logit_dtype(logits.dtype())) {
    bad_arg("logits must be float32, float16 or bfloat16");
  }
  const int B = logits.shape(0);
  const int V = logits.shape(1);
  if (B < 1 || V < 1) {
    bad_arg("logits must have B >= 1 and V >= 1, got " + shape_str(logits.shape()));
  }
  require_shape("uniforms", uniforms, {B}, "[B]");
  require_shape("params", params, {B, kParamCols}, "[B, 7]");
  auto st = mx::to_stream(s);
  check_cpu_threads(st);
  std::vector<mx::array> inputs = {
      mx::contiguous(logits, false, st),
      float_input("uniforms", uniforms, st),
      float_input("params", params, st)};
  if (token_counts) {
    inputs.push_back(counts_input(*token_counts, B, V, st));
  }
  if (extra_tokens) {
    auto& e = *extra_tokens;
    if (e.ndim() != 2 || e.shape(0) != B || e.shape(1) > kMaxChainDrafts) {
      bad_arg(
          "extra_tokens must have shape [B, E] with B = " + std::to_string(B) +
          " and E <= " + std::to_string(kMaxChainDrafts) + ", got " +
          shape_str(e.shape()));
    }
    inputs.push_back(token_ids("extra_tokens", e, st));
  }
  auto bias = logit_bias_inputs(logit_bias_ids, logit_bias_values, B, V, st);
  inputs.insert(inputs.end(), bias.begin(), bias.end());
  return mx::array(
      {B},
      mx::int32,
      std::make_shared<SampleTokens>(
          st, token_counts.has_value(), extra_tokens.has_value(), !bias.empty()),
      std::move(inputs));
}

bool SampleTokens::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const SampleTokens&>(other);
  return has_counts_ == o.has_counts_ && has_extra_ == o.has_extra_ &&
      has_bias_ == o.has_bias_;
}

std::vector<mx::Shape> SampleTokens::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0)}};
}

mx::array verify_sampled(
    const mx::array& verify_logits,
    const mx::array& draft_logits,
    const mx::array& tokens,
    const mx::array& uniforms,
    const mx::array& params,
    const std::optional<mx::array>& token_counts,
    mx::StreamOrDevice s) {
  check_verify_logits(verify_logits);
  const int B = verify_logits.shape(0);
  const int V = verify_logits.shape(2);
  check_draft_logits(draft_logits, verify_logits, {B, V}, "[B, V]");
  require_shape("tokens", tokens, {B, 2}, "[B, 2]");
  require_shape("uniforms", uniforms, {B, kUniformCols}, "[B, 3]");
  require_shape("params", params, {B, kParamCols}, "[B, 7]");
  auto st = mx::to_stream(s);
  auto inputs = verify_inputs(
      verify_logits,
      draft_logits,
      tokens,
      uniforms,
      params,
      token_counts,
      st);
  return mx::array(
      {B, kBundleCols},
      mx::int32,
      std::make_shared<VerifySampled>(st, token_counts.has_value()),
      std::move(inputs));
}

std::vector<mx::Shape> VerifySampled::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), kBundleCols}};
}

mx::array verify_sampled_chain(
    const mx::array& verify_logits,
    const mx::array& draft_logits,
    const mx::array& tokens,
    const mx::array& uniforms,
    const mx::array& params,
    const std::optional<mx::array>& token_counts,
    const std::optional<mx::array>& logit_bias_ids,
    const std::optional<mx::array>& logit_bias_values,
    mx::StreamOrDevice s) {
  const int K = check_chain_logits(verify_logits, kMaxChainDrafts);
  const int B = verify_logits.shape(0);
  const int V = verify_logits.shape(2);
  check_draft_logits(draft_logits, verify_logits, {B, K, V}, "[B, K, V]");
  require_shape("tokens", tokens, {B, K + 1}, "[B, K + 1]");
  require_shape("uniforms", uniforms, {B, K + 2}, "[B, K + 2]");
  require_shape("params", params, {B, kParamCols}, "[B, 7]");
  auto st = mx::to_stream(s);
  auto inputs = verify_inputs(
      verify_logits,
      draft_logits,
      tokens,
      uniforms,
      params,
      token_counts,
      st);
  auto bias = logit_bias_inputs(logit_bias_ids, logit_bias_values, B, V, st);
  inputs.insert(inputs.end(), bias.begin(), bias.end());
  return mx::array(
      {B, K + 3},
      mx::int32,
      std::make_shared<VerifySampledChain>(
          st,
          token_counts.has_value(),
          !bias.empty()),
      std::move(inputs));
}

std::vector<mx::Shape> VerifySampledChain::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1) + 2}};
}

} // namespace mtplx
