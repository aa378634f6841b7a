// Sampling kernels: sample_tokens and verify_sampled, one threadgroup per
// stream. The transform and the kept-set rules are those of
// python/mtplx_ext/sampling/reference.py (shared pieces in mtplx_rules.h), computed in
// float32: the kept prefix (top-k, top-p) comes from threshold searches by
// bisection over the ordered key of z with counting / mass passes over the
// row, never from a sort. Results equal the CPU kernels (double precision)
// except where a decision lies within float32 rounding of its boundary.
#pragma once

#include <metal_stdlib>

#include "mtplx_rules.h"

using namespace metal;

namespace mtplx {

MTPLX_CONST int kIntMax = 2147483647;
MTPLX_CONST int kIntMin = -2147483647 - 1;
// Largest float below 1: uniforms are used in [0, 1).
MTPLX_CONST float kOneBelowF = 0.99999994f;

// ---- Threadgroup context and reductions (every thread gets the result).

struct TgCtx {
  threadgroup float* f; // 32 floats of scratch
  threadgroup int* i; // 32 ints of scratch
  uint tid;
  uint n;
  uint lane;
  uint sg;
  uint nsg;
};

inline float tg_sum(float v, TgCtx c) {
  v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c.lane == 0) {
    c.f[c.sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float r = c.lane < c.nsg ? c.f[c.lane] : 0.0f;
  return simd_sum(r);
}

inline int tg_sum_int(int v, TgCtx c) {
  v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c.lane == 0) {
    c.i[c.sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int r = c.lane < c.nsg ? c.i[c.lane] : 0;
  return simd_sum(r);
}

inline int tg_max_int(int v, TgCtx c) {
  v = simd_max(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c.lane == 0) {
    c.i[c.sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int r = c.lane < c.nsg ? c.i[c.lane] : kIntMin;
  return simd_max(r);
}

inline int tg_min_int(int v, TgCtx c) {
  v = simd_min(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c.lane == 0) {
    c.i[c.sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int r = c.lane < c.nsg ? c.i[c.lane] : kIntMax;
  return simd_min(r);
}

// Exclusive prefix sum of one value per thread, in thread order.
inline float tg_prefix_exclusive(float v, TgCtx c) {
  float within = simd_prefix_exclusive_sum(v);
  float total = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c.lane == 0) {
    c.f[c.sg] = total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float offset = 0.0f;
  for (uint s = 0; s < c.sg; ++s) {
    offset += c.f[s];
  }
  return offset + within;
}

// ---- Logits of one row and the sampler of one stream.

template <typename K>
inline float to_float(typename K::bits_t b);

template <>
inline float to_float<F32Key>(uint b) {
  return as_type<float>(b);
}

template <>
inline float to_float<F16Key>(ushort b) {
  return float(as_type<half>(b));
}

template <>
inline float to_float<BF16Key>(ushort b) {
  return as_type<float>(uint(b) << 16);
}

struct SamplerRow {
  float temperature; // 0: greedy
  int top_k;
  float top_p;
  float min_p;
  float presence;
  float frequency;
  float repetition;
  bool penalties;
};

// Parameters outside their ranges act as "off", as on the CPU.
inline SamplerRow sampler_row(const device float* p) {
  SamplerRow s;
  float t = p[kParamTemperature];
  s.temperature = (t > 0.0f && isfinite(t)) ? t : 0.0f;
  float k = p[kParamTopK];
  s.top_k = (k >= 1.0f && k < 1073741824.0f) ? int(k) : 0;
  float tp = p[kParamTopP];
  s.top_p = tp < 1.0f ? tp : 1.0f;
  float mp = p[kParamMinP];
  s.min_p = mp > 0.0f ? mp : 0.0f;
  float pr = p[kParamPresence];
  float fr = p[kParamFrequency];
  float rp = p[kParamRepetition];
  s.presence = isfinite(pr) ? pr : 0.0f;
  s.frequency = isfinite(fr) ? fr : 0.0f;
  s.repetition = (isfinite(rp) && rp > 0.0f) ? rp : 1.0f;
  s.penalties =
      s.presence != 0.0f || s.frequency != 0.0f || s.repetition != 1.0f;
  return s;
}

template <typename K>
struct LogitRow {
  const device typename K::bits_t* x;
  const device int* counts; // read only when has_counts
  bool has_counts;
  int n_ex; // ids counted once more: ex[0..n_ex) (-1: counts nothing)
  int ex[kMaxExtraTokens];
  // The stream's logit bias as a dense [V] float32 row, added to the raw
  // logit in float32 before the penalties (read only when has_bias).
  const device float* bias;
  bool has_bias;
};

// Steps 0 to 2: z = penalised(l + bias) / T (T = 1 for greedy rows).
template <typename K>
inline float z_at(LogitRow<K> r, SamplerRow s, int i) {
  float l = to_float<K>(r.x[i]);
  if (r.has_bias) {
    l = l + r.bias[i];
  }
  if (s.penalties) {
    int extra = 0;
    for (int e = 0; e < r.n_ex; ++e) {
      extra += int(i == r.ex[e]);
    }
    int c = penalty_count(r.has_counts ? r.counts[i] : 0, extra);
    l = penalised_logit<float>(l, c, s.presence, s.frequency, s.repetition);
  }
  return s.temperature > 0.0f ? l / s.temperature : l;
}

inline int z_key(float z) {
  return F32Key::key(as_type<uint>(z));
}

inline float key_to_float(int k) {
  return as_type<float>(uint(k ^ ((k >> 31) & 0x7FFFFFFF)));
}

// The kept set of one distribution: a prefix of the order (z descending,
// index ascending) cut by top-k and top-p, then e >= min_p.
struct DistCut {
  bool valid;
  bool greedy;
  int arg; // greedy token
  float zmax;
  int k_key; // top-k cut: key > k_key, or key == k_key and index <= k_idx
  int k_idx;
  int p_key; // top-p cut, same form
  int p_idx;
  float min_p;
  float total; // sum of the kept weights
};

inline bool before_cut(int key, int i, int cut_key, int cut_idx) {
  return key > cut_key || (key == cut_key && i <= cut_idx);
}

template <typename K>
inline float weight_at(LogitRow<K> r, SamplerRow s, DistCut d, int i) {
  float z = z_at<K>(r, s, i);
  if (d.greedy) {
    return i == d.arg ? 1.0f : 0.0f;
  }
  int k = z_key(z);
  if (!before_cut(k, i, d.k_key, d.k_idx) ||
      !before_cut(k, i, d.p_key, d.p_idx)) {
    return 0.0f;
  }
  float e = exp(z - d.zmax);
  return e >= d.min_p ? e : 0.0f;
}

// Counting / mass pass over the row: elements before (key_t, idx_t) in the
// order and inside the top-k cut; with `mass`, the sum of their e.
template <typename K>
inline float prefix_pass(
    LogitRow<K> r,
    SamplerRow s,
    DistCut d,
    int V,
    int key_t,
    int idx_t,
    bool mass,
    TgCtx c) {
  float acc = 0.0f;
  int cnt = 0;
  for (int i = int(c.tid); i < V; i += int(c.n)) {
    float z = z_at<K>(r, s, i);
    int k = z_key(z);
    if (before_cut(k, i, key_t, idx_t) && before_cut(k, i, d.k_key, d.k_idx)) {
      if (mass) {
        acc += exp(z - d.zmax);
      } else {
        cnt += 1;
      }
    }
  }
  return mass ? tg_sum(acc, c) : float(tg_sum_int(cnt, c));
}

// The first element of the order at which the count reaches `rank + 1`
// (mass == false) or the cumulative e reaches `target` (mass == true):
// bisection over the key, then over the index among equal keys.
template <typename K>
inline void find_cut(
    LogitRow<K> r,
    SamplerRow s,
    DistCut d,
    int V,
    int lo,
    int hi,
    bool mass,
    float goal,
    TgCtx c,
    thread int& cut_key,
    thread int& cut_idx) {
  // Largest key t whose prefix (key >= t) reaches the goal.
  while (lo < hi) {
    int mid = int(lo + (long(hi) - long(lo) + 1) / 2);
    float got = prefix_pass<K>(r, s, d, V, mid, kIntMax, mass, c);
    if (got >= goal) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  // Smallest index among that key whose prefix reaches the goal.
  int a = 0, b = V - 1;
  while (a < b) {
    int mid = (a + b) / 2;
    float got = prefix_pass<K>(r, s, d, V, lo, mid, mass, c);
    if (got >= goal) {
      b = mid;
    } else {
      a = mid + 1;
    }
  }
  cut_key = lo;
  cut_idx = a;
}

template <typename K>
inline DistCut build_dist(LogitRow<K> r, SamplerRow s, int V, TgCtx c) {
  DistCut d;
  d.greedy = !(s.temperature > 0.0f);
  d.k_key = kIntMin;
  d.k_idx = kIntMax;
  d.p_key = kIntMin;
  d.p_idx = kIntMax;
  d.min_p = s.min_p;
  d.total = 1.0f;
  d.arg = kInvalid;
  // Validity (raw keys), the largest z with its lowest index, smallest z.
  int raw_hi = kIntMin, raw_lo = kIntMax, z_hi = kIntMin, z_lo = kIntMax;
  int arg = kIntMax;
  for (int i = int(c.tid); i < V; i += int(c.n)) {
    int rk = K::key(r.x[i]);
    raw_hi = max(raw_hi, rk);
    raw_lo = min(raw_lo, rk);
    int zk = z_key(z_at<K>(r, s, i));
    if (zk > z_hi) {
      z_hi = zk;
      arg = i;
    }
    z_lo = min(z_lo, zk);
  }
  raw_hi = tg_max_int(raw_hi, c);
  raw_lo = tg_min_int(raw_lo, c);
  d.valid = row_is_valid(raw_hi, raw_lo, K::pos_inf(), K::neg_inf());
  int top = tg_max_int(z_hi, c);
  d.arg = tg_min_int(z_hi == top ? arg : kIntMax, c);
  z_lo = tg_min_int(z_lo, c);
  d.zmax = key_to_float(top);
  if (!d.valid || d.greedy) {
    return d;
  }
  const int kk = top_k_length(s.top_k, V);
  if (kk < V) {
    find_cut<K>(r, s, d, V, z_lo, top, false, float(kk), c, d.k_key, d.k_idx);
  }
  if (s.top_p < 1.0f) {
    float total_k = prefix_pass<K>(r, s, d, V, kIntMin, kIntMax, true, c);
    find_cut<K>(
        r, s, d, V, z_lo, top, true, s.top_p * total_k, c, d.p_key, d.p_idx);
  }
  float acc = 0.0f;
  for (int i = int(c.tid); i < V; i += int(c.n)) {
    acc += weight_at<K>(r, s, d, i);
  }
  d.total = tg_sum(acc, c);
  return d;
}

// Inverse CDF in vocabulary order over weights w(i) = weight of `a`, or with
// `residual` max(w_a(i) / |a| - w_b(i) / |b|, 0); each thread owns one
// contiguous chunk. Returns the token (every thread), or kInvalid when the
// weights have no mass.
template <typename K>
inline float draw_weight(
    LogitRow<K> ra,
    SamplerRow sa,
    DistCut da,
    LogitRow<K> rb,
    SamplerRow sb,
    DistCut db,
    bool residual,
    int i) {
  float wa = weight_at<K>(ra, sa, da, i);
  if (!residual) {
    return wa;
  }
  float diff = wa / da.total - weight_at<K>(rb, sb, db, i) / db.total;
  return diff > 0.0f ? diff : 0.0f;
}

template <typename K>
inline int draw_token(
    LogitRow<K> ra,
    SamplerRow sa,
    DistCut da,
    LogitRow<K> rb,
    SamplerRow sb,
    DistCut db,
    bool residual,
    float u,
    int V,
    TgCtx c) {
  const int chunk = (V + int(c.n) - 1) / int(c.n);
  const int begin = min(V, int(c.tid) * chunk);
  const int end = min(V, begin + chunk);
  float mine = 0.0f;
  int last_pos = -1;
  for (int i = begin; i < end; ++i) {
    float w = draw_weight<K>(ra, sa, da, rb, sb, db, residual, i);
    mine += w;
    last_pos = w > 0.0f ? i : last_pos;
  }
  float before = tg_prefix_exclusive(mine, c);
  float total = tg_sum(mine, c);
  int last = tg_max_int(last_pos, c);
  if (!(total > 0.0f)) {
    return kInvalid;
  }
  const float target = clamp_uniform<float>(u, kOneBelowF) * total;
  int pick = kIntMax;
  if (mine > 0.0f && before <= target && target < before + mine) {
    float run = before;
    for (int i = begin; i < end; ++i) {
      run += draw_weight<K>(ra, sa, da, rb, sb, db, residual, i);
      if (run > target) {
        pick = i;
        break;
      }
    }
  }
  pick = tg_min_int(pick, c);
  return pick == kIntMax ? last : pick;
}

// The token after a rejected draft: from the residual max(p - q, 0) where
// q is usable (use_q), from p otherwise or where the residual has no mass
// (p == q up to rounding). Uniform across the threadgroup.
template <typename K>
inline int draw_rejected(
    LogitRow<K> rp,
    SamplerRow sp,
    DistCut p,
    LogitRow<K> rq,
    SamplerRow sq,
    DistCut q,
    bool use_q,
    float u,
    int V,
    TgCtx c) {
  int t = kInvalid;
  if (use_q) {
    t = draw_token<K>(rp, sp, p, rq, sq, q, true, u, V, c);
  }
  if (t == kInvalid) {
    t = draw_token<K>(rp, sp, p, rp, sp, p, false, u, V, c);
  }
  return t;
}

template <typename K>
inline float prob_of(LogitRow<K> r, SamplerRow s, DistCut d, int t) {
  return weight_at<K>(r, s, d, t) / d.total;
}

// ---- Kernels.

// logits [B, V] bits; uniforms [B]; params [B, kParamCols]; counts [B, V]
// (bound when has_counts); extra [B, n_extra] (bound when n_extra > 0);
// out [B] int; bias: with kBiased the dense [B, V] float32 logit bias (the
// ops layer scatters the padded (ids, values) into it; without it, unbound).
// sampling.metal instantiates both: sample_tokens_* and
// sample_tokens_biased_*. Grid: B threadgroups of a multiple of 32 threads.
template <typename K, typename TokT, bool kBiased>
[[kernel]] void sample_tokens(
    const device typename K::bits_t* logits [[buffer(0)]],
    const device float* uniforms [[buffer(1)]],
    const device float* params [[buffer(2)]],
    const device int* counts [[buffer(3)]],
    const device TokT* extra [[buffer(4)]],
    device int* out [[buffer(5)]],
    constant int& vocab [[buffer(6)]],
    constant int& has_counts [[buffer(7)]],
    constant int& n_extra [[buffer(8)]],
    const device float* bias [[buffer(9)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint tg_size [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float fs[32];
  threadgroup int is[32];
  TgCtx c{fs, is, tid, tg_size, lane, sg, num_sg};
  const int V = vocab;
  LogitRow<K> r;
  r.x = logits + size_t(row) * V;
  r.counts = counts + (has_counts ? size_t(row) * V : 0);
  r.has_counts = has_counts != 0;
  // Without kBiased the arm reading `bias` folds away at compile time: the
  // argument is inactive and the host leaves its slot unbound.
  r.bias = kBiased ? bias + size_t(row) * V : nullptr;
  r.has_bias = kBiased;
  r.n_ex = min(n_extra, kMaxExtraTokens);
  for (int e = 0; e < r.n_ex; ++e) {
    TokT t = extra[size_t(row) * n_extra + e];
    r.ex[e] = (t >= 0 && t < TokT(V)) ? int(t) : -1;
  }
  SamplerRow s = sampler_row(params + size_t(row) * kParamCols);
  DistCut d = build_dist<K>(r, s, V, c);
  int tok = kInvalid;
  if (d.valid) {
    tok = draw_token<K>(r, s, d, r, s, d, false, uniforms[row], V, c);
  }
  if (tid == 0) {
    out[row] = tok;
  }
}

// verify_logits [B, 2, V] and draft_logits [B, V] bits; tokens [B, 2];
// uniforms [B, kUniformCols]; params [B, kParamCols]; counts [B, V] (bound
// when has_counts); bundle [B, kBundleCols].
template <typename K, typename TokT>
[[kernel]] void verify_sampled(
    const device typename K::bits_t* vlogits [[buffer(0)]],
    const device typename K::bits_t* dlogits [[buffer(1)]],
    const device TokT* tokens [[buffer(2)]],
    const device float* uniforms [[buffer(3)]],
    const device float* params [[buffer(4)]],
    const device int* counts [[buffer(5)]],
    device int* bundle [[buffer(6)]],
    constant int& vocab [[buffer(7)]],
    constant int& has_counts [[buffer(8)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint tg_size [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float fs[32];
  threadgroup int is[32];
  TgCtx c{fs, is, tid, tg_size, lane, sg, num_sg};
  const int V = vocab;
  TokT x0_raw = tokens[size_t(row) * 2];
  TokT d_raw = tokens[size_t(row) * 2 + 1];
  const bool x0_ok = x0_raw >= 0 && x0_raw < TokT(V);
  const bool d_ok = d_raw >= 0 && d_raw < TokT(V);
  const int x0 = x0_ok ? int(x0_raw) : kInvalid;
  const int draft = d_ok ? int(d_raw) : kInvalid;
  const device float* u = uniforms + size_t(row) * kUniformCols;

  const SamplerRow s = sampler_row(params + size_t(row) * kParamCols);
  LogitRow<K> rp;
  rp.x = vlogits + size_t(row) * 2 * V;
  rp.counts = counts + (has_counts ? size_t(row) * V : 0);
  rp.has_counts = has_counts != 0;
  rp.bias = nullptr; // no bias: never read
  rp.has_bias = false;
  rp.n_ex = 1;
  rp.ex[0] = x0;
  LogitRow<K> rq = rp;
  rq.x = dlogits + size_t(row) * V;
  LogitRow<K> r1 = rp;
  r1.x = rp.x + V;
  r1.n_ex = 2;
  r1.ex[1] = draft;

  // Both verification rows are checked, as in verify_greedy; tokens first.
  // An unusable draft row (a broken head) only rejects the draft.
  DistCut p = build_dist<K>(rp, s, V, c);
  DistCut q = build_dist<K>(rq, s, V, c);
  DistCut p1 = build_dist<K>(r1, s, V, c);
  int second = kInvalid, accept = kInvalid, bonus = kInvalid;
  if (x0_ok && d_ok && p.valid && p1.valid) {
    float pd = prob_of<K>(rp, s, p, draft);
    float qd = q.valid ? prob_of<K>(rq, s, q, draft) : 0.0f;
    float ua = clamp_uniform<float>(u[kUniformAccept], kOneBelowF);
    if (q.valid && accepts_draft<float>(ua, qd, pd)) {
      accept = 1;
      second = draft;
      bonus = draw_token<K>(
          r1, s, p1, r1, s, p1, false, u[kUniformBonus], V, c);
    } else {
      accept = 0;
      second = draw_rejected<K>(
          rp, s, p, rq, s, q, q.valid, u[kUniformResample], V, c);
    }
  }
  if (tid == 0) {
    device int* out = bundle + size_t(row) * kBundleCols;
    out[kColX0] = x0;
    out[kColDraft] = draft;
    out[kColSecond] = second;
    out[kColAccept] = accept;
    out[kColBonus] = bonus;
  }
}

} // namespace mtplx
