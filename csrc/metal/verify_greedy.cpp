// eval_gpu of VerifyGreedy: one threadgroup per stream (metal/verify_greedy.h).
#include "metal/device.h"
#include "metal/launch_plan.h"
#include "primitives.h"

namespace mtplx {

namespace {

const char* logit_dtype_name(mx::Dtype t) {
  if (t == mx::float32) {
    return "float32";
  }
  return t == mx::float16 ? "float16" : "bfloat16";
}

} // namespace

void VerifyGreedy::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& logits = inputs[0]; // [B, 2, V], row contiguous (see ops.cpp)
  auto& tokens = inputs[1]; // [B, 2] int32 / int64
  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  const int B = logits.shape(0);
  const int V = logits.shape(2);
  auto* kernel = metal::get_kernel(
      d,
      metal::verify_greedy_kernel(
          logit_dtype_name(logits.dtype()), tokens.dtype() == mx::int64));
  const int threads = metal::verify_greedy_threads(
      V, int(kernel->maxTotalThreadsPerThreadgroup()));

  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(kernel);
  enc.set_input_array(logits, 0);
  enc.set_input_array(tokens, 1);
  enc.set_output_array(out, 2);
  enc.set_bytes(V, 3);
  enc.dispatch_threadgroups(MTL::Size(B, 1, 1), MTL::Size(threads, 1, 1));
}

} // namespace mtplx
