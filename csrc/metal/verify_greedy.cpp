// eval_gpu of VerifyGreedy: one threadgroup per stream (metal/verify_greedy.h).
#include "metal/device.h"
#include "metal/launch_plan.h"
#include "verify_primitives.h"

namespace mtplx {

void VerifyGreedy::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& logits = inputs[0]; // [B, 2, V], row contiguous (see verify_ops.cpp)
  auto& tokens = inputs[1]; // [B, 2] int32 / int64
  const int V = logits.shape(2);
  metal::launch_verify_rows(
      stream(),
      "verify_greedy",
      logits,
      tokens,
      out,
      metal::verify_greedy_threads,
      [&](auto& enc) {
        enc.set_input_array(logits, 0);
        enc.set_input_array(tokens, 1);
        enc.set_output_array(out, 2);
        enc.set_bytes(V, 3);
      });
}

void VerifyGreedyChain::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& logits = inputs[0]; // [B, K + 1, V], row contiguous (see verify_ops.cpp)
  auto& tokens = inputs[1]; // [B, K + 1] int32 / int64
  const int K = logits.shape(1) - 1;
  const int V = logits.shape(2);
  metal::launch_verify_rows(
      stream(),
      has_bias_ ? "verify_greedy_chain_biased" : "verify_greedy_chain",
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
        if (has_bias_) { // the dense [B, V] bias (verify_ops.cpp)
          enc.set_input_array(inputs[2], 5);
        }
      });
}

} // namespace mtplx
