// eval_gpu of VerifyGreedyChain and VerifySampledChain: one threadgroup per
// stream (metal/chain.h). An absent counts input is bound to a filler
// buffer that the kernel never reads (the flag says so).
#include <string>

#include "metal/device.h"
#include "metal/launch_plan.h"
#include "primitives.h"
#include "sampling_primitives.h"

namespace mtplx {

void VerifyGreedyChain::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& logits = inputs[0]; // [B, K + 1, V], row contiguous (see ops.cpp)
  auto& tokens = inputs[1]; // [B, K + 1] int32 / int64
  const int K = logits.shape(1) - 1;
  const int V = logits.shape(2);
  metal::launch_verify_rows(
      stream(),
      "verify_greedy_chain",
      logits,
      tokens,
      out,
      metal::verify_greedy_threads,
      [&](auto& enc) {
        enc.set_input_array(logits, 0);
        enc.set_input_array(tokens, 1);
        enc.set_output_array(out, 2);
        enc.set_bytes(V, 3);
        enc.set_bytes(K, 4);
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
      "verify_sampled_chain",
      vl,
      tokens,
      out,
      metal::sampling_threads,
      [&](auto& enc) {
        metal::bind_sampled_verify(enc, inputs, has_counts_, out, V, K);
      });
}

} // namespace mtplx
