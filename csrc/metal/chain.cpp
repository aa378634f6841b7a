// eval_gpu of VerifyGreedyChain and VerifySampledChain: one threadgroup per
// stream (metal/chain.h). An absent counts input is bound to a filler
// buffer that the kernel never reads (the flag says so).
#include <string>

#include "metal/device.h"
#include "metal/launch_plan.h"
#include "primitives.h"
#include "sampling_primitives.h"

namespace mtplx {

namespace {

std::string chain_dtype(mx::Dtype t) {
  return t == mx::float32 ? "float32"
                          : (t == mx::float16 ? "float16" : "bfloat16");
}

} // namespace

void VerifyGreedyChain::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& logits = inputs[0]; // [B, K + 1, V], row contiguous (see ops.cpp)
  auto& tokens = inputs[1]; // [B, K + 1] int32 / int64
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int B = logits.shape(0);
  const int K = logits.shape(1) - 1;
  const int V = logits.shape(2);

  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  auto* kernel = metal::get_kernel(
      d,
      metal::row_kernel(
          "verify_greedy_chain",
          chain_dtype(logits.dtype()),
          tokens.dtype() == mx::int64));
  const int threads = metal::verify_greedy_threads(
      V, int(kernel->maxTotalThreadsPerThreadgroup()));
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(kernel);
  enc.set_input_array(logits, 0);
  enc.set_input_array(tokens, 1);
  enc.set_output_array(out, 2);
  enc.set_bytes(V, 3);
  enc.set_bytes(K, 4);
  enc.dispatch_threadgroups(MTL::Size(B, 1, 1), MTL::Size(threads, 1, 1));
}

void VerifySampledChain::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& vl = inputs[0];
  auto& tokens = inputs[2];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int B = vl.shape(0);
  const int K = vl.shape(1) - 1;
  const int V = vl.shape(2);
  const int has_counts = has_counts_ ? 1 : 0;

  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  auto* kernel = metal::get_kernel(
      d,
      metal::row_kernel(
          "verify_sampled_chain",
          chain_dtype(vl.dtype()),
          tokens.dtype() == mx::int64));
  const int threads = metal::sampling_threads(
      V, int(kernel->maxTotalThreadsPerThreadgroup()));
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
  enc.set_bytes(K, 9);
  enc.dispatch_threadgroups(MTL::Size(B, 1, 1), MTL::Size(threads, 1, 1));
}

} // namespace mtplx
