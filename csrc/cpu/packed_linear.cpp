// eval_cpu of PackedLinear: the packed GEMM over x's rows. An input that is
// not row contiguous (rare: packed weights and most activations are) is
// gathered into a dense copy first, here rather than by a Contiguous node in
// the graph, which would cost a node on every decode-time Linear.
#include <vector>

#include "cpu/fused_common.h"
#include "cpu/packed_gemm.h"
#include "cpu/thread_pool.h"
#include "linear_primitives.h"

namespace mtplx {

namespace {

// a's floats in row-major order: its own buffer when it is row contiguous,
// else a copy in `buf`.
const float* dense(const mx::array& a, std::vector<float>& buf) {
  if (a.flags().row_contiguous) {
    return a.data<float>();
  }
  const int D = a.shape(-1);
  const int64_t rows = int64_t(a.size() / D);
  const cpu::RowWalker walk(a);
  buf.resize(a.size());
  for (int64_t r = 0; r < rows; ++r) {
    cpu::load_row<cpu::F32>(
        a.data<float>() + walk.offset(r), walk.col_stride(), D,
        buf.data() + r * D);
  }
  return buf.data();
}

} // namespace

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
    std::vector<float> x_buf, w_buf;
    cpu::packed_gemm(
        dense(x, x_buf), M, K, dense(wp, w_buf), n, out.data<float>(),
        cpu::cpu_threads_or_one());
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
