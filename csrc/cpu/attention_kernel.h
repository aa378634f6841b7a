// The CPU attention kernel shared by FusedAttention (float KV) and
// FusedQuantizedAttention (quantized KV): they differ only in how a run of
// key and value rows becomes float32 rows (a `Source`).
//
// A job is one (batch, kv head): its rows are the query rows of the heads
// sharing that kv head (n_rep * T of them: a verification's K + 1 positions
// and a GQA group). Its keys are cut into segments of kSegment slots at
// fixed, absolute boundaries. Each (job, segment) is one unit of work for
// the CPU pool; it reads its key and value rows once for all the job's rows
// and leaves, per row, the segment's softmax partial (maximum, sum of
// exponentials, weighted sum of values). A merge per job combines the
// partials in segment order. So a long context at batch 1 still splits over
// both cores, and each KV byte is read once per call.
//
// Scores come from tiles of 8 keys: 8-lane partial dot products per key,
// then the 8 keys' lanes summed at once (no horizontal sum per key); values
// are summed in key order, each value row loaded once per block of rows. Every step of a row
// depends only on that row, its keys and the fixed segment boundaries, never
// on the other rows of the call, the thread split or S: a verification of
// K + 1 positions gives each position what a one-token step gives it, bit
// for bit (MTP stays exactly lossless).
//
// Masking as mx::fast's fallback (attention_common.h): a bool or causal mask
// replaces a score by the dtype's lowest value, a fully masked row averages
// the values, a row whose maximum is not finite or that holds a NaN score is
// NaN. Segments no row of the job sees are skipped (a fixed-capacity ragged
// cache holds mostly such slots).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/attention_common.h"
#include "cpu/thread_pool.h"

// Multiply-adds fused where the CPU has them: the kernels' x86-64 clone is
// x86-64-v3 (AVX2 + FMA).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__)
#define MTPLX_ATTENTION_CLONES \
  __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MTPLX_ATTENTION_CLONES
#endif

namespace mtplx::cpu {

constexpr int kSegment = 256; // keys per unit of work (a multiple of 8)
constexpr int kRowBlock = 6; // rows whose accumulators stay in registers

// Rough single-thread cost of one query row against one key per element of
// D + Dv, in nanoseconds, and the least work worth a second thread.
constexpr double kAttentionNsPerElement = 0.06;
constexpr double kAttentionMinThreadNs = 15000.0;

// The queries of a call.
struct QueryView {
  const void* q;
  int64_t qs[4];
};

// The keys [a, e) of batch entry b, kv head g: what a unit reads.
struct SegmentAt {
  int b, g, a, e;
};

// A segment's key and value rows as float32 (Dp / Dvp wide, rows k_row /
// v_row floats apart), as a source gives them.
struct KVRows {
  const float* K;
  int64_t k_row;
  const float* V;
  int64_t v_row;
};

// Per-unit scratch, kept per thread between calls.
struct UnitScratch {
  std::vector<float> kbuf, vbuf; // the segment's key / value rows (if copied)
  std::vector<float> scores; // rows x kSegment
  std::vector<float> acc; // rows x Dvp
};

// A job's spans and where its units and partials start.
struct JobPlan {
  Spans spans;
  int seg0 = 0, segs = 0; // its segments: [seg0, seg0 + segs) of the S axis
  int unit0 = 0; // its first unit in the call's list
};

// Partial of one (unit, row): max, sum, NaN flag, then Dvp weighted sums.
MTPLX_FUSED_INLINE int partial_width(const Geometry& G) {
  return G.Dvp + 3;
}

// w[j] = sum of the lanes of v[j]: three levels of pairwise adds.
MTPLX_FUSED_INLINE vf8 lane_sums(const vf8* v) {
  vf8 a[4], c[2];
  for (int i = 0; i < 4; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
        __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
        __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
      __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Scores of one row q (Dp floats) against the 8 key rows at k[j * k_row]
// (out[j]): 8-lane partial dot products over the dimensions, then each
// key's lanes summed (lane_sums). Each score depends only on its row and
// key.
MTPLX_FUSED_INLINE void tile_scores(
    const Geometry& G,
    const float* q,
    const float* const* k,
    float* out) {
  vf8 a[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    a[j] = vf8{};
  }
  for (int c = 0; c < G.Dp; c += kLanes) {
    const vf8 qc = load8(q + c);
    for (int j = 0; j < kLanes; ++j) {
      a[j] += qc * load8(k[j] + c);
    }
  }
  store8(out, lane_sums(a));
}

// acc[r] += sum_i p[r][i] * vals[i], i < n, rows [0, R), in key order.
template <int R>
MTPLX_FUSED_INLINE void add_values(
    const Geometry& G,
    const float* p,
    int p_stride,
    const float* vals,
    int64_t v_row,
    int n,
    float* acc) {
  int c = 0;
  // Two vectors of columns at a time where they fit in registers (each
  // probability broadcast once per pair): 2 R accumulators, R <= 6.
  for (; c + 2 * kLanes <= G.Dvp; c += 2 * kLanes) {
    vf8 a[R], b[R];
    for (int r = 0; r < R; ++r) {
      a[r] = load8(acc + int64_t(r) * G.Dvp + c);
      b[r] = load8(acc + int64_t(r) * G.Dvp + c + kLanes);
    }
    for (int i = 0; i < n; ++i) {
      const vf8 va = load8(vals + i * v_row + c);
      const vf8 vb = load8(vals + i * v_row + c + kLanes);
      for (int r = 0; r < R; ++r) {
        const float w = p[int64_t(r) * p_stride + i];
        a[r] += w * va;
        b[r] += w * vb;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(acc + int64_t(r) * G.Dvp + c, a[r]);
      store8(acc + int64_t(r) * G.Dvp + c + kLanes, b[r]);
    }
  }
  for (; c < G.Dvp; c += kLanes) {
    vf8 a[R];
    for (int r = 0; r < R; ++r) {
      a[r] = load8(acc + int64_t(r) * G.Dvp + c);
    }
    for (int i = 0; i < n; ++i) {
      const vf8 vv = load8(vals + i * v_row + c);
      for (int r = 0; r < R; ++r) {
        a[r] += p[int64_t(r) * p_stride + i] * vv;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(acc + int64_t(r) * G.Dvp + c, a[r]);
    }
  }
}

// Calls f.template operator()<R>(row0) over `rows` rows in blocks of up to
// kRowBlock, as even in size as that allows.
template <class F>
MTPLX_FUSED_INLINE void for_row_blocks(int rows, F&& f) {
  const int blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int base = rows / blocks, extra = rows % blocks;
  int row0 = 0;
  for (int t = 0; t < blocks; ++t) {
    const int r = base + (t < extra);
    switch (r) {
      case 1:
        f.template operator()<1>(row0);
        break;
      case 2:
        f.template operator()<2>(row0);
        break;
      case 3:
        f.template operator()<3>(row0);
        break;
      case 4:
        f.template operator()<4>(row0);
        break;
      case 5:
        f.template operator()<5>(row0);
        break;
      default:
        f.template operator()<kRowBlock>(row0);
        break;
    }
    row0 += r;
  }
}

// The scaled queries of job (b, g) as rows of Dp floats (zero padded).
template <class S>
MTPLX_FUSED_INLINE void load_queries(
    const Geometry& G,
    const QueryView& qv,
    float scale,
    int b,
    int g,
    std::vector<float>& q) {
  using bits_t = typename S::bits_t;
  const int rows = G.n_rep * G.Tr;
  q.assign(size_t(rows) * G.Dp, 0.0f);
  for (int i = 0; i < rows; ++i) {
    const RowAt at = row_at(G, g, i);
    const bits_t* qr = static_cast<const bits_t*>(qv.q) + b * qv.qs[0] +
        at.head * qv.qs[1] + at.pos * qv.qs[2];
    float* qd = q.data() + int64_t(i) * G.Dp;
    load_row<S>(qr, qv.qs[3], G.D, qd);
    for (int d = 0; d < G.D; ++d) {
      qd[d] *= scale;
    }
  }
}

// One unit: keys [a, b) of job (bi, g) for every row of the job, its
// partials written to `part` (rows x partial_width). `Src` gives the float
// rows of keys and values: src.rows(SegmentAt, scratch) -> KVRows.
template <class S, class Src>
MTPLX_FUSED_INLINE void attend_unit(
    const Geometry& G,
    const Src& src,
    const MaskView& mask,
    AttentionMask kind,
    const JobPlan& plan,
    const float* q,
    int bi,
    int g,
    int a,
    int b,
    float* part) {
  thread_local UnitScratch sc;
  const int rows = G.n_rep * G.Tr;
  const int n = b - a; // a multiple of 8 but at the end of S
  const int n8 = round_up_lanes(n);
  const Spans& sp = plan.spans;
  const auto [K, k_row, V, v_row] = src.rows(SegmentAt{bi, g, a, b}, sc);
  sc.scores.resize(size_t(rows) * kSegment);
  // Scores, a tile of 8 keys at a time (lanes past the segment repeat its
  // last key; segment_softmax gives them weight 0).
  for (int t = 0; t < n8; t += kLanes) {
    // The key and value rows two tiles on, for the scores now and the
    // weighted sum of values after (a segment's rows are read once each).
    for (int j = t + 2 * kLanes; j < std::min(t + 3 * kLanes, n); ++j) {
      for (int c = 0; c < G.Dp; c += 16) {
        __builtin_prefetch(K + int64_t(j) * k_row + c);
      }
      for (int c = 0; c < G.Dvp; c += 16) {
        __builtin_prefetch(V + int64_t(j) * v_row + c);
      }
    }
    const float* krows[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      krows[j] = K + int64_t(t + std::min(j, n - 1 - t)) * k_row;
    }
    for (int i = 0; i < rows; ++i) {
      tile_scores(
          G, q + int64_t(i) * G.Dp, krows,
          sc.scores.data() + int64_t(i) * kSegment + t);
    }
  }
  // Masks and the segment's softmax per row (lanes past S get weight 0).
  const int pw = partial_width(G);
  for (int i = 0; i < rows; ++i) {
    float* sr = sc.scores.data() + int64_t(i) * kSegment;
    float* out = part + int64_t(i) * pw;
    float nan_flag = 0.0f;
    out[0] = segment_softmax<S>(
        sr, mask, kind, sp, i, bi, row_at(G, g, i), a, b, n8, out[1],
        nan_flag);
    out[2] = nan_flag;
  }
  sc.acc.assign(size_t(rows) * G.Dvp, 0.0f);
  for_row_blocks(rows, [&]<int R>(int row0) __attribute__((always_inline)) {
    add_values<R>(
        G, sc.scores.data() + int64_t(row0) * kSegment, kSegment, V, v_row,
        n, sc.acc.data() + int64_t(row0) * G.Dvp);
  });
  for (int i = 0; i < rows; ++i) {
    std::copy_n(
        sc.acc.data() + int64_t(i) * G.Dvp, G.Dvp,
        part + int64_t(i) * pw + 3);
  }
}

// Combines the partials of job (bi, g) in segment order into its rows of
// the output.
template <class S>
MTPLX_FUSED_INLINE void merge_job(
    const Geometry& G,
    const JobPlan& plan,
    const float* parts,
    void* out,
    int bi,
    int g) {
  const int rows = G.n_rep * G.Tr;
  const int pw = partial_width(G);
  const int64_t unit_stride = int64_t(rows) * pw;
  thread_local std::vector<float> acc;
  acc.resize(G.Dvp);
  for (int i = 0; i < rows; ++i) {
    float m = kNegInf;
    bool nan = false;
    for (int u = 0; u < plan.segs; ++u) {
      const float* p = parts + (plan.unit0 + u) * unit_stride + i * pw;
      m = std::max(m, p[0]);
      nan |= p[2] != 0.0f;
    }
    if (nan || !std::isfinite(m)) {
      write_row<S>(out, G, bi, row_at(G, g, i), 0, G.Dv, acc.data(), 0.0f);
      continue;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    float total = 0.0f;
    for (int u = 0; u < plan.segs; ++u) {
      const float* p = parts + (plan.unit0 + u) * unit_stride + i * pw;
      const float w = p[0] == kNegInf ? 0.0f : std::exp(p[0] - m);
      total += w * p[1];
      for (int c = 0; c < G.Dvp; ++c) {
        acc[c] += w * p[3 + c];
      }
    }
    write_row<S>(
        out, G, bi, row_at(G, g, i), 0, G.Dv, acc.data(), 1.0f / total);
  }
}

// What the units and merges of one call share: each job's plan, the units'
// jobs, the scaled queries and the partials.
struct AttentionPlan {
  std::vector<JobPlan> jobs;
  std::vector<int> unit_job;
  std::vector<std::vector<float>> queries;
  std::vector<float> parts;
  int units = 0;
};

// Plans a call: per job its spans and the segments any of its rows sees
// (all of [0, S) where a row sees no key: it averages every value), its
// scaled queries, room for the partials.
template <class S>
MTPLX_FUSED_INLINE void plan_attention(
    const Geometry& G,
    const QueryView& qv,
    const MaskView& mask,
    AttentionMask kind,
    float scale,
    AttentionPlan& plan) {
  const int jobs = G.B * G.Hkv;
  const int rows = G.n_rep * G.Tr;
  plan.jobs.assign(jobs, JobPlan{});
  plan.queries.resize(jobs);
  for (int j = 0; j < jobs; ++j) {
    JobPlan& p = plan.jobs[j];
    spans_of(G, mask, kind, j / G.Hkv, j % G.Hkv, rows, p.spans);
    const bool blind =
        std::find(p.spans.blind.begin(), p.spans.blind.end(), char(1)) !=
        p.spans.blind.end();
    if (blind) {
      p.spans.lo = 0;
      p.spans.hi = G.S;
    }
    p.seg0 = p.spans.lo / kSegment;
    p.segs = p.spans.hi > p.spans.lo
        ? (p.spans.hi - 1) / kSegment + 1 - p.seg0
        : 0;
    load_queries<S>(G, qv, scale, j / G.Hkv, j % G.Hkv, plan.queries[j]);
  }
  plan.units = 0;
  plan.unit_job.clear();
  for (int j = 0; j < jobs; ++j) {
    plan.jobs[j].unit0 = plan.units;
    plan.units += plan.jobs[j].segs;
    plan.unit_job.insert(plan.unit_job.end(), plan.jobs[j].segs, j);
  }
  plan.parts.resize(size_t(plan.units) * rows * partial_width(G));
}

// Unit u of a planned call: its job's keys [a, e), the job's span cut to
// the unit's segment.
template <class S, class Src>
MTPLX_FUSED_INLINE void run_unit(
    const Geometry& G,
    AttentionPlan& plan,
    const Src& src,
    const MaskView& mask,
    AttentionMask kind,
    int u) {
  const int j = plan.unit_job[u];
  const JobPlan& p = plan.jobs[j];
  const int seg = p.seg0 + (u - p.unit0);
  const int a = std::max(seg * kSegment, p.spans.lo);
  const int e = std::min((seg + 1) * kSegment, p.spans.hi);
  const int rows = G.n_rep * G.Tr;
  attend_unit<S>(
      G, src, mask, kind, p, plan.queries[j].data(), j / G.Hkv, j % G.Hkv, a,
      e, plan.parts.data() + size_t(u) * rows * partial_width(G));
}

template <class S>
MTPLX_FUSED_INLINE void run_merge(
    const Geometry& G,
    const AttentionPlan& plan,
    void* out,
    int j) {
  merge_job<S>(G, plan.jobs[j], plan.parts.data(), out, j / G.Hkv, j % G.Hkv);
}

// The units on the CPU pool, then the merges: unit(u) and merge(j) are the
// kernel file's clones (run_unit / run_merge for its dtype and source).
template <class Unit, class Merge>
void execute_attention(
    const Geometry& G,
    const AttentionPlan& plan,
    Unit&& unit,
    Merge&& merge) {
  const int rows = G.n_rep * G.Tr;
  const double cost = double(plan.units) * kSegment * rows * (G.D + G.Dv) *
      kAttentionNsPerElement;
  int threads = 1;
  if (plan.units > 1 && cost >= 2 * kAttentionMinThreadNs) {
    threads = std::min<int>(
        {cpu_threads_or_one(), plan.units, int(cost / kAttentionMinThreadNs)});
  }
  parallel_for(plan.units, threads, unit, cost);
  const int jobs = G.B * G.Hkv;
  const double merge_cost = double(plan.units) * rows * G.Dvp;
  int merge_threads = 1;
  if (jobs > 1 && merge_cost >= 2 * kAttentionMinThreadNs) {
    merge_threads = std::min(cpu_threads_or_one(), jobs);
  }
  parallel_for(jobs, merge_threads, merge, merge_cost);
}

// Runs a call in chunks of query positions whose partials fit in about
// kPartialBytes (a prefill's thousands of positions; a decode step is one
// chunk): plan(Gc) then execute(Gc) for each chunk's geometry Gc.
constexpr double kPartialBytes = 32.0 * (1 << 20);

template <class Plan, class Execute>
void in_position_chunks(const Geometry& G, Plan&& plan, Execute&& execute) {
  const double per_position = double(G.B) * G.Hkv *
      ((G.S + kSegment - 1) / kSegment) * G.n_rep * (G.Dvp + 3) * 4.0;
  const int chunk =
      std::max(1, std::min(G.T, int(kPartialBytes / per_position)));
  for (int t0 = 0; t0 < G.T; t0 += chunk) {
    Geometry Gc = G;
    Gc.t0 = t0;
    Gc.Tr = std::min(chunk, G.T - t0);
    plan(Gc);
    execute(Gc);
  }
}

// The merges of a planned call (cpu/attention.cpp, an x86-64-v3 clone):
// job j's rows of `out` in dtype's storage.
void merge_cpu(
    mx::Dtype dtype,
    const Geometry& G,
    const AttentionPlan& plan,
    void* out,
    int j);

// A whole call: plans and runs each chunk of positions. unit(Gc, plan, u)
// and merge(Gc, plan, j) call the kernel file's clones of run_unit /
// run_merge. The plan is kept per calling thread (the stream's); the pool's
// threads reach it by reference.
template <class Unit, class Merge>
void run_attention(
    mx::Dtype dtype,
    const Geometry& G,
    const QueryView& qv,
    const MaskView& mask,
    AttentionMask kind,
    float scale,
    Unit&& unit,
    Merge&& merge) {
  thread_local AttentionPlan kept;
  AttentionPlan& plan = kept;
  in_position_chunks(
      G,
      [&](const Geometry& Gc) {
        with_float_dtype(dtype, [&]<class S>() {
          plan_attention<S>(Gc, qv, mask, kind, scale, plan);
        });
      },
      [&](const Geometry& Gc) {
        execute_attention(
            Gc,
            plan,
            [&](int u) { unit(Gc, plan, u); },
            [&](int j) { merge(Gc, plan, j); });
      });
}

// The geometry of q [B, Hq, T, D] against Hkv kv heads of S slots, values
// Dv wide.
inline Geometry geometry_of(const mx::array& q, int Hkv, int S, int Dv) {
  Geometry G;
  G.B = q.shape(0);
  G.Hq = q.shape(1);
  G.T = q.shape(2);
  G.t0 = 0;
  G.Tr = G.T;
  G.D = q.shape(3);
  G.Hkv = Hkv;
  G.S = S;
  G.Dv = Dv;
  G.n_rep = G.Hq / G.Hkv;
  G.Dp = round_up_lanes(G.D);
  G.Dvp = round_up_lanes(G.Dv);
  G.Sp = round_up_lanes(G.S);
  return G;
}

} // namespace mtplx::cpu
