// eval_gpu of SampleTokens and VerifySampled: one threadgroup per stream
// (metal/sampling.h). Absent optional inputs are bound to a filler buffer
// that the kernels never read (the flags say so).
#include <algorithm>
#include <string>

#include "metal/device.h"
#include "metal/launch_plan.h"
#include "sampling_primitives.h"

namespace mtplx {

namespace {

std::string dtype_name(mx::Dtype logits) {
  return logits == mx::float32
      ? "float32"
      : (logits == mx::float16 ? "float16" : "bfloat16");
}

std::string sampling_kernel(
    const char* op,
    mx::Dtype logits,
    mx::Dtype tokens) {
  return metal::row_kernel(op, dtype_name(logits), tokens == mx::int64);
}

} // namespace

void SampleTokens::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& logits = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int B = logits.shape(0);
  const int V = logits.shape(1);
  const mx::array* counts = has_counts_ ? &inputs[3] : nullptr;
  const mx::array* extra = has_extra_ ? &inputs[has_counts_ ? 4 : 3] : nullptr;
  const int has_counts = counts ? 1 : 0;
  const int n_extra = extra ? extra->shape(1) : 0;

  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  auto* kernel = metal::get_kernel(
      d,
      sampling_kernel(
          "sample_tokens", logits.dtype(), extra ? extra->dtype() : mx::int32));
  const int threads =
      metal::sampling_threads(V, int(kernel->maxTotalThreadsPerThreadgroup()));
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(kernel);
  enc.set_input_array(logits, 0);
  enc.set_input_array(inputs[1], 1);
  enc.set_input_array(inputs[2], 2);
  enc.set_input_array(counts ? *counts : logits, 3);
  enc.set_input_array(extra ? *extra : logits, 4);
  enc.set_output_array(out, 5);
  enc.set_bytes(V, 6);
  enc.set_bytes(has_counts, 7);
  enc.set_bytes(n_extra, 8);
  enc.dispatch_threadgroups(MTL::Size(B, 1, 1), MTL::Size(threads, 1, 1));
}

void VerifySampled::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& vl = inputs[0];
  auto& tokens = inputs[2];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int B = vl.shape(0);
  const int V = vl.shape(2);
  const int has_counts = has_counts_ ? 1 : 0;
  const int variant = static_cast<int>(variant_);

  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  auto* kernel = metal::get_kernel(
      d, sampling_kernel("verify_sampled", vl.dtype(), tokens.dtype()));
  const int threads =
      metal::sampling_threads(V, int(kernel->maxTotalThreadsPerThreadgroup()));
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(kernel);
  enc.set_input_array(vl, 0);
  enc.set_input_array(inputs[1], 1);
  enc.set_input_array(tokens, 2);
  enc.set_input_array(inputs[3], 3);
  enc.set_input_array(inputs[4], 4);
  enc.set_input_array(has_counts_ ? inputs[5] : vl, 5);
  enc.set_output_array(out, 6);
  enc.set_bytes(V, 7);
  enc.set_bytes(has_counts, 8);
  enc.set_bytes(variant, 9);
  enc.dispatch_threadgroups(MTL::Size(B, 1, 1), MTL::Size(threads, 1, 1));
}

} // namespace mtplx
