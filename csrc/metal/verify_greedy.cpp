// eval_gpu of VerifyGreedy: one threadgroup per stream (metal/verify_greedy.h).
#include "metal/device.h"
#include "metal/launch_plan.h"
#include "primitives.h"

namespace mtplx {

void VerifyGreedy::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& logits = inputs[0]; // [B, 2, V], row contiguous (see ops.cpp)
  auto& tokens = inputs[1]; // [B, 2] int32 / int64
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int B = logits.shape(0);
  const int V = logits.shape(2);
  metal::launch_rows(
      stream(),
      metal::verify_greedy_kernel(
          metal::logit_dtype_name(logits.dtype()),
          tokens.dtype() == mx::int64),
      B,
      V,
      metal::verify_greedy_threads,
      [&](auto& enc) {
        enc.set_input_array(logits, 0);
        enc.set_input_array(tokens, 1);
        enc.set_output_array(out, 2);
        enc.set_bytes(V, 3);
      });
}

} // namespace mtplx
