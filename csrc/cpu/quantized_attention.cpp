// eval_cpu of FusedQuantizedAttention: attention over keys and values held
// in MLX's affine quantized layout (mx.quantize along the head dimension, as
// mlx-lm's QuantizedKVCache stores them), read directly: no dequantized copy
// of the cache is made.
//
// Per (batch, kv head) -- the jobs, split over the CPU pool when large
// enough -- the query rows of the heads sharing that kv head go over the
// visible keys in chunks of kChunk: a chunk of key rows is dequantized once
// (w = scale * q + bias, float32) into a small buffer and scored against every
// row of the job; after the softmax the value rows are dequantized the same
// way, once per chunk, and accumulated into every row. So each quantized KV
// byte is read once per job whatever the number of query rows (the K + 1
// positions of a verification and the query heads of a GQA group).
//
// Per row the arithmetic is the float kernel's (attention.cpp): scores as
// 8-lane dot products, the shared masking and softmax, values summed in key
// order. A row's result does not depend on the other rows of the call, so a
// verification of K + 1 positions gives each position what a one-token step
// gives it.
#include <algorithm>
#include <cstdint>
#include <cstring>
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
constexpr int kChunk = 32;
constexpr double kNsPerElement = 0.05;
constexpr double kMinThreadNs = 30000.0;

// A packed [B, Hkv, S, words] uint32 array with its scales and biases
// [B, Hkv, S, groups] (any float dtype, any strides).
struct Packed {
  const uint32_t* w;
  int64_t ws[4];
  const void* s;
  int64_t ss[4];
  const void* b;
  int64_t bs[4];
  mx::Dtype sdtype = mx::float32;
  int width; // dequantized row length (D or Dv)
};

struct QInputs {
  const void* q;
  int64_t qs[4];
  Packed k, v;
  MaskView mask;
  void* out;
  int bits, group_size;
};

MTPLX_FUSED_INLINE float load_any(mx::Dtype dt, const void* p, int64_t i) {
  if (dt == mx::float32) {
    return static_cast<const float*>(p)[i];
  }
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dt == mx::float16 ? half_bits_to_float(h) : bf16_bits_to_float(h);
}

// Row s of job (b, g) of `pk` dequantized into dst[0, width), zero padded
// to `padded`. Values are an LSB-first bit stream over the row's words.
MTPLX_FUSED_INLINE void dequant_row(
    const Packed& pk,
    int b,
    int g,
    int s,
    int bits,
    int group_size,
    int padded,
    float* dst) {
  const int words = pk.width * bits / 32;
  const uint32_t* w = pk.w + b * pk.ws[0] + g * pk.ws[1] + s * pk.ws[2];
  if (pk.ws[3] != 1) {
    thread_local std::vector<uint32_t> local;
    local.resize(words);
    for (int j = 0; j < words; ++j) {
      local[j] = w[j * pk.ws[3]];
    }
    w = local.data();
  }
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w);
  const int64_t so = b * pk.ss[0] + g * pk.ss[1] + s * pk.ss[2];
  const int64_t bo = b * pk.bs[0] + g * pk.bs[1] + s * pk.bs[2];
  const int nbytes = words * 4;
  for (int g0 = 0, gi = 0; g0 < pk.width; g0 += group_size, ++gi) {
    const float sc = load_any(pk.sdtype, pk.s, so + gi * pk.ss[3]);
    const float bi = load_any(pk.sdtype, pk.b, bo + gi * pk.bs[3]);
    const int end = g0 + group_size;
    if (bits == 8) {
      for (int d = g0; d < end; ++d) {
        dst[d] = sc * float(bytes[d]) + bi;
      }
    } else if (bits == 4) {
      for (int d = g0; d < end; ++d) {
        dst[d] = sc * float((bytes[d >> 1] >> ((d & 1) * 4)) & 15) + bi;
      }
    } else {
      const uint32_t mask = (1u << bits) - 1;
      for (int d = g0; d < end; ++d) {
        const int bit = d * bits, at = bit >> 3;
        uint32_t two = bytes[at];
        if (at + 1 < nbytes) {
          two |= uint32_t(bytes[at + 1]) << 8;
        }
        dst[d] = sc * float((two >> (bit & 7)) & mask) + bi;
      }
    }
  }
  std::fill(dst + pk.width, dst + padded, 0.0f);
}

struct Scratch {
  std::vector<float> q; // rows x Dp, scaled queries
  std::vector<float> scores; // rows x Sp
  std::vector<float> acc; // rows x Dvp
  std::vector<float> chunk; // kChunk x max(Dp, Dvp)
  std::vector<float> inv_sum; // rows
  Spans spans;
};

// Scores of rows [r0, r0 + R) against the n dequantized key rows in `keys`
// (keys s0 + i), written to scores[r * Sp + s0 + i].
template <int R>
MTPLX_FUSED_INLINE void score_rows(
    const Geometry& G,
    const float* q,
    const float* keys,
    int s0,
    int n,
    float* scores) {
  for (int i = 0; i < n; ++i) {
    const float* kr = keys + int64_t(i) * G.Dp;
    vf8 a[R];
    for (int r = 0; r < R; ++r) {
      a[r] = vf8{};
    }
    for (int c = 0; c < G.Dp; c += kLanes) {
      const vf8 kc = load8(kr + c);
      for (int r = 0; r < R; ++r) {
        a[r] += load8(q + int64_t(r) * G.Dp + c) * kc;
      }
    }
    for (int r = 0; r < R; ++r) {
      scores[int64_t(r) * G.Sp + s0 + i] = hsum8(a[r]);
    }
  }
}

// acc[r] += sum_i p[r][s0 + i] * vals[i] for rows [r0, r0 + R), in key order.
template <int R>
MTPLX_FUSED_INLINE void accumulate_rows(
    const Geometry& G,
    const float* p,
    const float* vals,
    int s0,
    int n,
    float* acc) {
  for (int c = 0; c < G.Dvp; c += kLanes) {
    vf8 a[R];
    for (int r = 0; r < R; ++r) {
      a[r] = load8(acc + int64_t(r) * G.Dvp + c);
    }
    for (int i = 0; i < n; ++i) {
      const vf8 vv = load8(vals + int64_t(i) * G.Dvp + c);
      for (int r = 0; r < R; ++r) {
        a[r] += p[int64_t(r) * G.Sp + s0 + i] * vv;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(acc + int64_t(r) * G.Dvp + c, a[r]);
    }
  }
}

// Calls f.template operator()<R>(row0) for the rows of a job in blocks of
// up to kBlockRows, as even in size as that allows.
template <class F>
MTPLX_FUSED_INLINE void for_blocks(int rows, F&& f) {
  const int blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int base = rows / blocks, extra = rows % blocks;
  int row0 = 0;
  for (int t = 0; t < blocks; ++t) {
    const int r = base + (t < extra);
    switch (r) {
      case 1: f.template operator()<1>(row0); break;
      case 2: f.template operator()<2>(row0); break;
      case 3: f.template operator()<3>(row0); break;
      case 4: f.template operator()<4>(row0); break;
      case 5: f.template operator()<5>(row0); break;
      case 6: f.template operator()<6>(row0); break;
      case 7: f.template operator()<7>(row0); break;
      default: f.template operator()<8>(row0); break;
    }
    row0 += r;
  }
}

template <class S>
MTPLX_FUSED_INLINE void qattend_job(
    const Geometry& G,
    const QInputs& in,
    AttentionMask kind,
    float scale,
    int b,
    int g) {
  using bits_t = typename S::bits_t;
  thread_local Scratch sc;
  const int rows = G.n_rep * G.T;
  spans_of(G, in.mask, kind, b, g, rows, sc.spans);
  const int lo = sc.spans.lo, hi = sc.spans.hi;
  sc.q.assign(size_t(rows) * G.Dp, 0.0f);
  sc.scores.resize(size_t(rows) * G.Sp);
  sc.acc.assign(size_t(rows) * G.Dvp, 0.0f);
  sc.chunk.resize(size_t(kChunk) * std::max(G.Dp, G.Dvp));
  sc.inv_sum.resize(rows);
  for (int i = 0; i < rows; ++i) {
    const RowAt at = row_at(G, g, i);
    const bits_t* qr = static_cast<const bits_t*>(in.q) + b * in.qs[0] +
        at.head * in.qs[1] + at.pos * in.qs[2];
    float* qd = sc.q.data() + int64_t(i) * G.Dp;
    load_row<S>(qr, in.qs[3], G.D, qd);
    for (int d = 0; d < G.D; ++d) {
      qd[d] *= scale;
    }
  }

  for (int s0 = lo; s0 < hi; s0 += kChunk) {
    const int n = std::min(kChunk, hi - s0);
    for (int i = 0; i < n; ++i) {
      dequant_row(
          in.k, b, g, s0 + i, in.bits, in.group_size, G.Dp,
          sc.chunk.data() + int64_t(i) * G.Dp);
    }
    for_blocks(rows, [&]<int R>(int row0) {
      score_rows<R>(
          G, sc.q.data() + int64_t(row0) * G.Dp, sc.chunk.data(), s0, n,
          sc.scores.data() + int64_t(row0) * G.Sp);
    });
  }
  for (int i = 0; i < rows; ++i) {
    sc.inv_sum[i] = softmax_row<S>(
        sc.scores.data() + int64_t(i) * G.Sp, in.mask, kind, sc.spans, i, b,
        row_at(G, g, i), lo, hi);
  }
  for (int s0 = lo; s0 < hi; s0 += kChunk) {
    const int n = std::min(kChunk, hi - s0);
    for (int i = 0; i < n; ++i) {
      dequant_row(
          in.v, b, g, s0 + i, in.bits, in.group_size, G.Dvp,
          sc.chunk.data() + int64_t(i) * G.Dvp);
    }
    for_blocks(rows, [&]<int R>(int row0) {
      accumulate_rows<R>(
          G, sc.scores.data() + int64_t(row0) * G.Sp, sc.chunk.data(), s0, n,
          sc.acc.data() + int64_t(row0) * G.Dvp);
    });
  }
  for (int i = 0; i < rows; ++i) {
    write_row<S>(
        in.out, G, b, row_at(G, g, i), 0, G.Dv,
        sc.acc.data() + int64_t(i) * G.Dvp, sc.inv_sum[i]);
  }
}

MTPLX_FUSED_CLONES void qattention_job_cpu(
    mx::Dtype dtype,
    const Geometry& G,
    const QInputs& in,
    AttentionMask kind,
    float scale,
    int job) {
  const int b = job / G.Hkv, g = job % G.Hkv;
  if (dtype == mx::float32) {
    qattend_job<F32>(G, in, kind, scale, b, g);
  } else if (dtype == mx::float16) {
    qattend_job<F16>(G, in, kind, scale, b, g);
  } else {
    qattend_job<BF16>(G, in, kind, scale, b, g);
  }
}

Packed packed_of(
    const mx::array& w,
    const mx::array& s,
    const mx::array& b,
    int group_size) {
  Packed p;
  p.w = w.data<uint32_t>();
  p.s = s.data<void>();
  p.b = b.data<void>();
  p.sdtype = s.dtype();
  for (int i = 0; i < 4; ++i) {
    p.ws[i] = w.strides()[i];
    p.ss[i] = s.strides()[i];
    p.bs[i] = b.strides()[i];
  }
  p.width = s.shape(3) * group_size;
  return p;
}

} // namespace

void FusedQuantizedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [kind = mask_, scale = scale_, bits = bits_, gs = group_size_](
                 std::vector<mx::array>& in, mx::array& out) {
    const mx::array& q = in[0];
    Geometry G;
    G.B = q.shape(0);
    G.Hq = q.shape(1);
    G.T = q.shape(2);
    G.D = q.shape(3);
    G.Hkv = in[1].shape(1);
    G.S = in[1].shape(2);
    G.Dv = in[5].shape(3) * gs;
    G.n_rep = G.Hq / G.Hkv;
    G.Dp = round_up_lanes(G.D);
    G.Dvp = round_up_lanes(G.Dv);
    G.Sp = round_up_lanes(G.S);
    if (out.size() == 0) {
      return;
    }
    QInputs qi;
    qi.q = q.data<void>();
    for (int i = 0; i < 4; ++i) {
      qi.qs[i] = q.strides()[i];
    }
    qi.k = packed_of(in[1], in[2], in[3], gs);
    qi.v = packed_of(in[4], in[5], in[6], gs);
    qi.mask = MaskView(in.size() > 7 ? &in[7] : nullptr);
    qi.out = out.data<void>();
    qi.bits = bits;
    qi.group_size = gs;
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
        [&](int j) { qattention_job_cpu(dtype, G, qi, kind, scale, j); },
        cost);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
