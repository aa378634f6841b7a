// eval_cpu of PackedLinear and PackedQuantizedLinear: the packed GEMMs over
// x's rows. An input that is not float32 and row contiguous (rare: packed
// weights and most activations are) is gathered into a dense float32 copy
// first, here rather than by a Contiguous node in
// the graph, which would cost a node on every decode-time Linear.
#include <vector>

#include "cpu/fused_common.h"
#include "cpu/packed_gemm.h"
#include "cpu/qgemm.h"
#include "cpu/thread_pool.h"
#include "linear_primitives.h"

namespace mtplx {

namespace {

// Rows [0, rows) of a (last axis D, any strides) widened to float32 in buf.
template <class S>
void gather(const mx::array& a, std::vector<float>& buf) {
  const int D = a.shape(-1);
  const int64_t rows = int64_t(a.size() / D);
  const cpu::RowWalker walk(a);
  const auto* src = a.data<typename S::bits_t>();
  buf.resize(a.size());
  for (int64_t r = 0; r < rows; ++r) {
    cpu::load_row<S>(src + walk.offset(r), walk.col_stride(), D, buf.data() + r * D);
  }
}

// a's values (float32, float16 or bfloat16) as float32 rows in row-major
// order: its own buffer when it is float32 and row contiguous, else a copy
// in `buf`.
const float* dense(const mx::array& a, std::vector<float>& buf) {
  if (a.dtype() == mx::float16) {
    gather<cpu::F16>(a, buf);
  } else if (a.dtype() == mx::bfloat16) {
    gather<cpu::BF16>(a, buf);
  } else if (a.flags().row_contiguous) {
    return a.data<float>();
  } else {
    gather<cpu::F32>(a, buf);
  }
  return buf.data();
}

// y's float32 values rounded into a 16-bit output (as MLX's casts round).
template <class S>
void store(const std::vector<float>& y, mx::array& out) {
  auto* o = out.data<uint16_t>();
  for (size_t i = 0; i < y.size(); ++i) {
    o[i] = S::store(y[i]);
  }
}

cpu::ScaleType scale_type(mx::Dtype t) {
  return t == mx::float32 ? cpu::ScaleType::f32
      : t == mx::float16  ? cpu::ScaleType::f16
                          : cpu::ScaleType::bf16;
}

} // namespace

void PackedQuantizedLinear::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [n = n_, gs = group_size_, bits = bits_](
                 std::vector<mx::array>& in, mx::array& out) {
    const mx::array& x = in[0];
    const mx::array& wq = in[1];
    const mx::array& sb = in[2];
    const int K = wq.shape(1) * gs;
    const int64_t M = int64_t(x.size() / K);
    if (M == 0) {
      return;
    }
    // The op makes wq and sb row contiguous.
    std::vector<float> x_buf, y_buf;
    float* y = out.dtype() == mx::float32
        ? out.data<float>()
        : (y_buf.resize(size_t(M) * n), y_buf.data());
    cpu::qgemm(
        dense(x, x_buf), M, K, wq.data<uint8_t>(), sb.data<void>(),
        scale_type(sb.dtype()), n, gs, bits, y, cpu::cpu_threads_or_one());
    if (out.dtype() == mx::float16) {
      store<cpu::F16>(y_buf, out);
    } else if (out.dtype() == mx::bfloat16) {
      store<cpu::BF16>(y_buf, out);
    }
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

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
