// eval_cpu of PackedLinear: the packed GEMM over x's rows.
#include "cpu/fused_common.h"
#include "cpu/packed_gemm.h"
#include "cpu/thread_pool.h"
#include "linear_primitives.h"

namespace mtplx {

void PackedLinear::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [n = n_](std::vector<mx::array>& in, mx::array& out) {
    const mx::array& x = in[0];
    const mx::array& wp = in[1];
    const int K = wp.shape(1);
    const int64_t M = K > 0 ? int64_t(x.size() / K) : 0;
    if (M == 0) {
      return;
    }
    cpu::packed_gemm(
        x.data<float>(), M, K, wp.data<float>(), n, out.data<float>(),
        cpu::cpu_threads_or_one());
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
