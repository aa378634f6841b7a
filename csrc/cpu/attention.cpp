// eval_cpu of FusedAttention. Per (batch, kv head) -- the jobs, split over
// the CPU pool when they are large enough -- the query rows of the heads
// sharing that kv head run in blocks of up to eight:
//   scores = Q_block K^T over key blocks of 8 transposed once per job (one
//   key-block load per 8-row update, no horizontal sums), softmax, then
//   out = P V over the value rows, each value vector loaded once per block.
// Scores, softmax and the weighted sum of values are float32; the output is
// rounded once to the dtype.
//
// Masking follows mx::fast's fallback: a bool (or causal) mask replaces a
// score by the dtype's lowest finite value, so a fully masked row averages
// the values uniformly; an additive mask is added to the score. A row whose
// maximum score is not finite (all -inf, +inf) or that holds a NaN score is
// written as NaN, as the fallback's softmax yields.
//
// Keys before a block's first visible key or after its last (a bool or
// causal mask) get weight exactly 0 in the fallback and are skipped here:
// with a fixed-capacity ragged KV cache most slots lie past every stream's
// end. (So a NaN in such a masked-out value row does not reach the output,
// where the fallback's 0 * NaN would.)
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/attention_common.h"
#include "cpu/fused_common.h"
#include "cpu/thread_pool.h"
#include "fused_primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtplx {

namespace {

using namespace cpu;

constexpr int kBlockRows = 8;

// Rough single-thread cost of one query row against one key (score and
// weighted value) per element of D + Dv, in nanoseconds (order of
// magnitude only), and the least work a second thread must get.
constexpr double kNsPerElement = 0.05;
constexpr double kMinThreadNs = 30000.0;

struct Inputs {
  const void* q;
  int64_t qs[4];
  const void* k;
  int64_t ks[4];
  const void* v;
  int64_t vs[4];
  MaskView mask;
  void* out;
};

// Per-job scratch, kept per thread between evaluations.
struct Scratch {
  std::vector<float> kbuf; // key rows widened to Dp floats
  std::vector<float> vbuf; // value rows widened to Dvp floats
  std::vector<float> q; // kBlockRows x Dp, scaled queries (zero padded)
  std::vector<float> scores; // kBlockRows x Sp
  Spans spans;
};

// The key and value rows of one job as float32 rows a multiple of 8 wide.
struct Rows {
  const float* k;
  int64_t k_row;
  const float* v;
  int64_t v_row;
};

// What every row block of job (b, g) reads.
struct Job {
  const Geometry& G;
  const Inputs& in;
  AttentionMask kind;
  float scale;
  int b, g;
  const Rows& kv;
  Scratch& sc;
};

// Rows [row0, row0 + R) of job (b, g), keys [lo, hi): the union of the
// rows' spans.
template <class S, int R>
MTPLX_FUSED_INLINE void attend_block(const Job& job, int row0) {
  using bits_t = typename S::bits_t;
  const Geometry& G = job.G;
  const Inputs& in = job.in;
  const int b = job.b, g = job.g;
  const Rows& kv = job.kv;
  Scratch& sc = job.sc;
  const Spans& sp = sc.spans;
  int lo = G.S, hi = 0;
  RowAt at[R];
  for (int r = 0; r < R; ++r) {
    at[r] = row_at(G, g, row0 + r);
    const bits_t* qr = static_cast<const bits_t*>(in.q) + b * in.qs[0] +
        at[r].head * in.qs[1] + at[r].pos * in.qs[2];
    float* qd = sc.q.data() + r * G.Dp;
    load_row<S>(qr, in.qs[3], G.D, qd);
    for (int d = 0; d < G.D; ++d) {
      qd[d] *= job.scale;
    }
    lo = std::min(lo, sp.first[row0 + r]);
    hi = std::max(hi, sp.last[row0 + r]);
  }

  // Scores: each key row loaded once per block, vectors over d.
  for (int s = lo; s < hi; ++s) {
    const float* kr = kv.k + s * kv.k_row;
    vf8 a[R];
    for (int r = 0; r < R; ++r) {
      a[r] = vf8{};
    }
    for (int c = 0; c < G.Dp; c += kLanes) {
      const vf8 kc = load8(kr + c);
      for (int r = 0; r < R; ++r) {
        a[r] += load8(sc.q.data() + r * G.Dp + c) * kc;
      }
    }
    for (int r = 0; r < R; ++r) {
      sc.scores[r * G.Sp + s] = hsum8(a[r]);
    }
  }

  float inv_sum[R];
  for (int r = 0; r < R; ++r) {
    inv_sum[r] = softmax_row<S>(
        sc.scores.data() + r * G.Sp, in.mask, job.kind, sp, row0 + r, b,
        at[r], lo, hi);
  }

  // Weighted sum of the value rows, one vector of columns at a time.
  for (int c = 0; c < G.Dvp; c += kLanes) {
    vf8 a[R];
    for (int r = 0; r < R; ++r) {
      a[r] = vf8{};
    }
    for (int s = lo; s < hi; ++s) {
      const vf8 vv = load8(kv.v + s * kv.v_row + c);
      for (int r = 0; r < R; ++r) {
        a[r] += sc.scores[r * G.Sp + s] * vv;
      }
    }
    const int n = std::min(kLanes, G.Dv - c);
    for (int r = 0; r < R; ++r) {
      float acc[kLanes];
      store8(acc, a[r]);
      write_row<S>(in.out, G, b, at[r], c, n, acc, inv_sum[r]);
    }
  }
}

template <class S, int R = kBlockRows>
MTPLX_FUSED_INLINE void block_of(int r, const Job& job, int row0) {
  if constexpr (R >= 1) {
    if (r == R) {
      attend_block<S, R>(job, row0);
    } else {
      block_of<S, R - 1>(r, job, row0);
    }
  }
}

// Rows [lo, hi) of keys or values of (b, g) as float32 rows `padded` wide:
// the array itself where it already is, else a widened copy (row s at s *
// padded, the padding zero).
template <class S>
MTPLX_FUSED_INLINE const float* widened(
    const void* data,
    const int64_t* st,
    int b,
    int g,
    int lo,
    int hi,
    int width,
    int padded,
    std::vector<float>& buf,
    int64_t& row_stride) {
  using bits_t = typename S::bits_t;
  const bits_t* base = static_cast<const bits_t*>(data) + b * st[0] + g * st[1];
  if (std::is_same_v<S, F32> && st[3] == 1 && width == padded) {
    row_stride = st[2];
    return reinterpret_cast<const float*>(base);
  }
  if (buf.size() < size_t(hi) * padded) {
    buf.resize(size_t(hi) * padded);
  }
  for (int s = lo; s < hi; ++s) {
    float* dst = buf.data() + int64_t(s) * padded;
    load_row<S>(base + s * st[2], st[3], width, dst);
    std::fill(dst + width, dst + padded, 0.0f);
  }
  row_stride = padded;
  return buf.data();
}

// Job (b, g): spans, the key and value rows any row sees (widened if need
// be), then the row blocks (as even in size as kBlockRows allows).
template <class S>
MTPLX_FUSED_INLINE void attend_job(
    const Geometry& G,
    const Inputs& in,
    AttentionMask kind,
    float scale,
    int b,
    int g) {
  thread_local Scratch sc;
  const int rows = G.n_rep * G.T;
  spans_of(G, in.mask, kind, b, g, rows, sc.spans);
  const int lo = sc.spans.lo, hi = sc.spans.hi;

  Rows kv;
  kv.k = widened<S>(in.k, in.ks, b, g, lo, hi, G.D, G.Dp, sc.kbuf, kv.k_row);
  kv.v = widened<S>(in.v, in.vs, b, g, lo, hi, G.Dv, G.Dvp, sc.vbuf, kv.v_row);

  sc.q.assign(size_t(kBlockRows) * G.Dp, 0.0f);
  sc.scores.resize(size_t(kBlockRows) * G.Sp);
  const Job job{G, in, kind, scale, b, g, kv, sc};
  const int blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int base = rows / blocks, extra = rows % blocks;
  int row0 = 0;
  for (int t = 0; t < blocks; ++t) {
    const int r = base + (t < extra);
    block_of<S>(r, job, row0);
    row0 += r;
  }
}

MTPLX_FUSED_CLONES void attention_job_cpu(
    mx::Dtype dtype,
    const Geometry& G,
    const Inputs& in,
    AttentionMask kind,
    float scale,
    int job) {
  const int b = job / G.Hkv, g = job % G.Hkv;
  if (dtype == mx::float32) {
    attend_job<F32>(G, in, kind, scale, b, g);
  } else if (dtype == mx::float16) {
    attend_job<F16>(G, in, kind, scale, b, g);
  } else {
    attend_job<BF16>(G, in, kind, scale, b, g);
  }
}

void attention_cpu(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array* mask,
    AttentionMask kind,
    float scale,
    mx::array& out) {
  Geometry G;
  G.B = q.shape(0);
  G.Hq = q.shape(1);
  G.T = q.shape(2);
  G.D = q.shape(3);
  G.Hkv = k.shape(1);
  G.S = k.shape(2);
  G.Dv = v.shape(3);
  G.n_rep = G.Hq / G.Hkv;
  G.Dp = round_up_lanes(G.D);
  G.Dvp = round_up_lanes(G.Dv);
  G.Sp = round_up_lanes(G.S);
  if (out.size() == 0) {
    return;
  }
  Inputs in;
  in.q = q.data<void>();
  in.k = k.data<void>();
  in.v = v.data<void>();
  for (int i = 0; i < 4; ++i) {
    in.qs[i] = q.strides()[i];
    in.ks[i] = k.strides()[i];
    in.vs[i] = v.strides()[i];
  }
  in.mask = MaskView(mask);
  in.out = out.data<void>();

  const int jobs = G.B * G.Hkv;
  const double cost = double(jobs) * G.n_rep * G.T * G.S * (G.D + G.Dv) *
      kNsPerElement;
  int threads = 1;
  if (jobs > 1 && cost >= 2 * kMinThreadNs) {
    threads = std::min<int>(
        {cpu_threads_or_one(), jobs, int(cost / kMinThreadNs)});
  }
  const mx::Dtype dtype = q.dtype();
  parallel_for(
      jobs,
      threads,
      [&](int job) { attention_job_cpu(dtype, G, in, kind, scale, job); },
      cost);
}

} // namespace

void FusedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [kind = mask_, scale = scale_](
                 std::vector<mx::array>& in, mx::array& out) {
    const mx::array* mask = in.size() > 3 ? &in[3] : nullptr;
    attention_cpu(in[0], in[1], in[2], mask, kind, scale, out);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
