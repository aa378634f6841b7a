// eval_cpu of PackedLinear and PackedQuantizedLinear: the packed GEMMs over
// x's rows. An input that is not float32 and row contiguous (rare: packed
// weights and most activations are) is gathered into a dense float32 copy
// first, here rather than by a Contiguous node in
// the graph, which would cost a node on every decode-time Linear.
#include <algorithm>
#include <cstring>
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

// Row `row`'s q values [K] from the packed stream (qgemm.h's layout).
void packed_row_q(
    const uint8_t* wq,
    int row,
    int G,
    int gs,
    int bits,
    uint8_t* q) {
  const bool nib = cpu::q_nibbles(bits);
  const int steps = gs / cpu::q_step_k(bits);
  const int64_t block = int64_t(steps) * 256;
  const int panel = row / kQPanel, col = row % kQPanel;
  const int64_t lane = (col / 16) * 64 + (col % 16) * 4;
  for (int g = 0; g < G; ++g) {
    const uint8_t* b = wq + (int64_t(panel) * G + g) * block + lane;
    uint8_t* qg = q + int64_t(g) * gs;
    for (int st = 0; st < steps; ++st, b += 256) {
      for (int t = 0; t < 4; ++t) {
        if (nib) {
          qg[8 * st + t] = b[t] & 15;
          qg[8 * st + 4 + t] = b[t] >> 4;
        } else {
          qg[4 * st + t] = b[t];
        }
      }
    }
  }
}

// Where row `row`'s scale of group g sits in sb (its bias: + kQPanel).
inline int64_t scale_at(int row, int G, int g) {
  return ((int64_t(row / kQPanel) * G + g) * 2) * kQPanel + row % kQPanel;
}

// Rows ids[0, count) dequantized as mx.dequantize does in the scales'
// storage type S: round_S(round_S(q * s) + b), each step rounded.
template <class S>
void dequantized_rows(
    const uint8_t* wq,
    const uint8_t* sb_bytes,
    const int32_t* ids,
    size_t count,
    int n,
    int G,
    int gs,
    int bits,
    typename S::bits_t* out) {
  using T = typename S::bits_t;
  const T* sb = reinterpret_cast<const T*>(sb_bytes);
  const int K = G * gs;
  std::vector<uint8_t> q(static_cast<size_t>(K));
  for (size_t r = 0; r < count; ++r) {
    const int row = std::clamp(ids[r], 0, n - 1);
    packed_row_q(wq, row, G, gs, bits, q.data());
    T* o = out + r * K;
    for (int g = 0; g < G; ++g) {
      const int64_t at = scale_at(row, G, g);
      const float s = S::load(sb[at]), b = S::load(sb[at + kQPanel]);
      for (int k = g * gs; k < (g + 1) * gs; ++k) {
        const float scaled = S::round(float(q[k]) * s);
        o[k] = S::store(scaled + b);
      }
    }
  }
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
    if (in.size() == 5) {
      const mx::array& nq = in[3];
      cpu::qgemm_prefetch_next(
          nq.data<uint8_t>(), nq.shape(0), int64_t(nq.nbytes()),
          in[4].data<void>(), int64_t(in[4].nbytes()),
          cpu::cpu_threads_or_one());
    }
    if (out.dtype() == mx::float16) {
      store<cpu::F16>(y_buf, out);
    } else if (out.dtype() == mx::bfloat16) {
      store<cpu::BF16>(y_buf, out);
    }
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

void PackedQuantizedRows::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto job = [n = n_, gs = group_size_, bits = bits_, deq = dequantize_](
                 std::vector<mx::array>& in, std::vector<mx::array>& out) {
    const mx::array& wq = in[0];
    const mx::array& sb = in[1];
    const mx::array& ids = in[2];
    const int G = wq.shape(1);
    const int K = G * gs;
    const int words = K * bits / 32;
    // Scales and biases are copied as stored (2 or 4 bytes each).
    const size_t esz = sb.itemsize();
    const auto* src_sb = sb.data<uint8_t>();
    const auto* w = wq.data<uint8_t>();
    const auto* id = ids.data<int32_t>();
    if (deq) {
      cpu::with_float_dtype(sb.dtype(), [&]<class S>() {
        dequantized_rows<S>(w, src_sb, id, ids.size(), n, G, gs, bits,
                            out[0].data<typename S::bits_t>());
      });
      return;
    }
    auto* ow = out[0].data<uint32_t>();
    auto* os = out[1].data<uint8_t>();
    auto* ob = out[2].data<uint8_t>();
    std::vector<uint8_t> q(static_cast<size_t>(K));
    for (size_t r = 0; r < ids.size(); ++r) {
      const int row = std::clamp(id[r], 0, n - 1);
      packed_row_q(w, row, G, gs, bits, q.data());
      for (int g = 0; g < G; ++g) {
        const int64_t at = scale_at(row, G, g);
        std::memcpy(os + (r * G + g) * esz, src_sb + at * esz, esz);
        std::memcpy(
            ob + (r * G + g) * esz, src_sb + (at + kQPanel) * esz, esz);
      }
      // MLX's bit stream: value k at bits [k bits, (k + 1) bits) of the
      // row's little-endian words.
      uint32_t* dst = ow + r * words;
      uint64_t acc = 0;
      int have = 0, out_w = 0;
      for (int k = 0; k < K; ++k) {
        acc |= uint64_t(q[k]) << have;
        have += bits;
        if (have >= 32) {
          dst[out_w++] = uint32_t(acc);
          acc >>= 32;
          have -= 32;
        }
      }
    }
  };
  cpu::dispatch_cpu_outputs(stream(), inputs, outputs, std::move(job));
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
