// eval_gpu of SampleTokens, VerifySampled and VerifySampledChain: one
// threadgroup per stream (metal/sampling.h, metal/chain.h). Absent optional
// inputs are bound to a filler buffer that the kernels never read (the flags
// say so); with a logit bias the *_biased kernels take its dense [B, V] row
// per stream.
#include <string>

#include "metal/device.h"
#include "metal/launch_plan.h"
#include "sampling_primitives.h"

namespace mtplx {

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
  metal::launch_rows(
      stream(),
      metal::row_kernel(
          has_bias_ ? "sample_tokens_biased" : "sample_tokens",
          metal::logit_dtype_name(logits.dtype()),
          extra && extra->dtype() == mx::int64),
      B,
      V,
      metal::sampling_threads,
      [&](auto& enc) {
        enc.set_input_array(logits, 0);
        enc.set_input_array(inputs[1], 1);
        enc.set_input_array(inputs[2], 2);
        enc.set_input_array(counts ? *counts : logits, 3);
        enc.set_input_array(extra ? *extra : logits, 4);
        enc.set_output_array(out, 5);
        enc.set_bytes(V, 6);
        enc.set_bytes(has_counts, 7);
        enc.set_bytes(n_extra, 8);
        if (has_bias_) { // the dense [B, V] bias, last (sampling_ops.cpp)
          enc.set_input_array(inputs.back(), 9);
        }
      });
}

void VerifySampled::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& vl = inputs[0];
  auto& tokens = inputs[2];
  const int V = vl.shape(2);
  metal::launch_verify_rows(
      stream(),
      "verify_sampled",
      vl,
      tokens,
      out,
      metal::sampling_threads,
      [&](auto& enc) {
        metal::bind_sampled_verify(enc, inputs, has_counts_, out, V);
      });
}

void VerifySampledChain::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& vl = inputs[0];
  auto& tokens = inputs[2];
  const int K = vl.shape(1) - 1;
  const int V = vl.shape(2);
  metal::launch_verify_rows(
      stream(),
      has_bias_ ? "verify_sampled_chain_biased" : "verify_sampled_chain",
      vl,
      tokens,
      out,
      metal::sampling_threads,
      [&](auto& enc) {
        metal::bind_sampled_verify(enc, inputs, has_counts_, out, V);
        enc.set_bytes(K, 9);
        if (has_bias_) { // the dense [B, V] bias, last (sampling_ops.cpp)
          enc.set_input_array(inputs.back(), 10);
        }
      });
}

} // namespace mtplx
