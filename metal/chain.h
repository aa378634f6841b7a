// Depth-K chain verification kernels: verify_greedy_chain and
// verify_sampled_chain, one threadgroup per stream. A row's verification
// positions are read one after another, only as far as the chain gets; the
// rules are those of python/mtplx_ext/sampling/reference.py (shared pieces in
// mtplx_rules.h), the sampled transforms those of sampling.h.
#pragma once

#include <metal_stdlib>

#include "mtplx_rules.h"
#include "sampling.h"
#include "verify_greedy.h"

using namespace metal;

namespace mtplx {

// The key of logit i of a row as the greedy scan compares it: the dtype's
// own ordered key of x[i] or, with kBiased, the float32 key of
// float32(x[i]) + bias[i] (`bias` is read only then), as the CPU scans its
// biased float32 copy of the row.
template <typename K, bool kBiased>
inline int scan_key(
    const device typename K::bits_t* x,
    const device float* bias,
    uint i) {
  if (kBiased) {
    return F32Key::key(as_type<uint>(to_float<K>(x[i]) + bias[i]));
  }
  return K::key(x[i]);
}

// Whether a row scanned with scan_key<K, kBiased> is usable. A biased row is
// judged on its biased float32 values, as on the CPU.
template <typename K, bool kBiased>
inline bool scan_is_valid(ArgmaxAcc a) {
  if (kBiased) {
    return row_is_valid(
        a.key, a.min_key, F32Key::pos_inf(), F32Key::neg_inf());
  }
  return row_is_valid(a.key, a.min_key, K::pos_inf(), K::neg_inf());
}

// Argmax of one row of V logits keyed by scan_key, over the whole
// threadgroup (its min_key feeds scan_is_valid); every thread gets the
// result. `partials` holds 3 * 32 ints.
template <typename K, bool kBiased>
inline ArgmaxAcc tg_row_argmax(
    const device typename K::bits_t* x,
    const device float* bias,
    int V,
    threadgroup int* partials,
    uint tid,
    uint tg_size,
    uint lane,
    uint sg,
    uint num_sg) {
  // Strided scan: each thread sees its indices in increasing order, so a
  // strict comparison keeps the lowest index of equal keys.
  ArgmaxAcc a = argmax_identity();
  for (uint i = tid; i < uint(V); i += tg_size) {
    int k = scan_key<K, kBiased>(x, bias, i);
    if (k > a.key) {
      a.key = k;
      a.idx = int(i);
    }
    a.min_key = min(a.min_key, k);
  }
  a = simd_argmax(a);
  if (lane == 0) {
    partials[sg] = a.key;
    partials[32 + sg] = a.idx;
    partials[64 + sg] = a.min_key;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  ArgmaxAcc r = argmax_identity();
  if (lane < num_sg) {
    r.key = partials[lane];
    r.idx = partials[32 + lane];
    r.min_key = partials[64 + lane];
  }
  r = simd_argmax(r);
  // The next call overwrites the partials: everyone must have read them.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return r;
}

// One chain bundle row [x0, n, c_1..c_{K+1}] (as csrc/cpu/chain_bundle.h).
inline void write_chain_row(
    device int* out,
    int K,
    int x0,
    int n,
    thread const int* c) {
  out[kChainColX0] = x0;
  out[kChainColAccepted] = n;
  for (int j = 0; j <= K; ++j) {
    out[kChainColFirst + j] = (n >= 0 && j <= n) ? c[j] : kInvalid;
  }
}

// logits [B, K + 1, V] raw bits; tokens [B, K + 1]; bundle [B, K + 3];
// bias: with kBiased the dense [B, V] float32 logit bias, added to every
// verification row of the stream before its argmax (without it, unbound).
// chain.metal instantiates both: verify_greedy_chain_* and
// verify_greedy_chain_biased_*. Grid: B threadgroups of a multiple of 32
// threads up to 1024.
template <typename K, typename TokT, bool kBiased>
[[kernel]] void verify_greedy_chain(
    const device typename K::bits_t* logits [[buffer(0)]],
    const device TokT* tokens [[buffer(1)]],
    device int* bundle [[buffer(2)]],
    constant int& vocab [[buffer(3)]],
    constant int& drafts [[buffer(4)]],
    const device float* bias [[buffer(5)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint tg_size [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  threadgroup int partials[3 * 32];
  const int V = vocab;
  const int KD = min(drafts, kMaxChainDrafts);
  const int T = KD + 1;
  const device TokT* tok = tokens + size_t(row) * T;
  const device typename K::bits_t* x = logits + size_t(row) * T * V;
  // Without kBiased the arm reading `bias` folds away at compile time: the
  // argument is inactive and the host leaves its slot unbound.
  const device float* br = kBiased ? bias + size_t(row) * V : nullptr;
  const TokT x0 = tok[0];
  const bool x0_ok = x0 >= 0 && x0 < TokT(V);
  int c[kMaxChainDrafts + 1];
  int n = kInvalid;
  if (x0_ok) {
    ArgmaxAcc a = tg_row_argmax<K, kBiased>(
        x, br, V, partials, tid, tg_size, lane, sg, num_sg);
    n = scan_is_valid<K, kBiased>(a) ? 0 : kInvalid;
    // Uniform across the threadgroup: every thread takes the same path.
    while (n >= 0 && n < KD) {
      const TokT d = tok[n + 1];
      if (!(d >= 0 && d < TokT(V)) || int(d) != a.idx) {
        break;
      }
      ArgmaxAcc next = tg_row_argmax<K, kBiased>(
          x + size_t(n + 1) * V, br, V, partials, tid, tg_size, lane, sg,
          num_sg);
      if (!scan_is_valid<K, kBiased>(next)) {
        n = kInvalid;
        break;
      }
      c[n] = int(d);
      a = next;
      ++n;
    }
    if (n >= 0) {
      c[n] = a.idx;
    }
  }
  if (tid == 0) {
    write_chain_row(
        bundle + size_t(row) * (KD + 3), KD, x0_ok ? int(x0) : kInvalid, n, c);
  }
}

// verify_logits [B, K + 1, V] and draft_logits [B, K, V] bits; tokens
// [B, K + 1]; uniforms [B, K + 2]; params [B, kParamCols]; counts [B, V]
// (bound when has_counts); bundle [B, K + 3]; bias: with kBiased the
// stream's dense [B, V] logit bias, added to its target and draft rows
// (without it, unbound). chain.metal instantiates both:
// verify_sampled_chain_* and verify_sampled_chain_biased_*.
template <typename K, typename TokT, bool kBiased>
[[kernel]] void verify_sampled_chain(
    const device typename K::bits_t* vlogits [[buffer(0)]],
    const device typename K::bits_t* dlogits [[buffer(1)]],
    const device TokT* tokens [[buffer(2)]],
    const device float* uniforms [[buffer(3)]],
    const device float* params [[buffer(4)]],
    const device int* counts [[buffer(5)]],
    device int* bundle [[buffer(6)]],
    constant int& vocab [[buffer(7)]],
    constant int& has_counts [[buffer(8)]],
    constant int& drafts [[buffer(9)]],
    const device float* bias [[buffer(10)]],
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
  const int KD = min(drafts, kMaxChainDrafts);
  const int T = KD + 1;
  const device TokT* tok = tokens + size_t(row) * T;
  const device float* u = uniforms + size_t(row) * (KD + 2);
  const TokT x0_raw = tok[0];
  const bool x0_ok = x0_raw >= 0 && x0_raw < TokT(V);
  SamplerRow s = sampler_row(params + size_t(row) * kParamCols);
  // rp / rq: the current position's target and draft rows; ex holds x0 and
  // the drafts (-1 for an id outside the vocabulary, which counts nothing).
  LogitRow<K> rp;
  rp.counts = counts + (has_counts ? size_t(row) * V : 0);
  rp.has_counts = has_counts != 0;
  // Without kBiased the arm reading `bias` folds away at compile time: the
  // argument is inactive and the host leaves its slot unbound.
  rp.bias = kBiased ? bias + size_t(row) * V : nullptr;
  rp.has_bias = kBiased;
  for (int j = 0; j < T; ++j) {
    const TokT t = tok[j];
    rp.ex[j] = (t >= 0 && t < TokT(V)) ? int(t) : -1;
  }
  const device typename K::bits_t* vrow = vlogits + size_t(row) * T * V;
  const device typename K::bits_t* drow = dlogits + size_t(row) * KD * V;
  LogitRow<K> rq = rp;
  int out[kMaxChainDrafts + 1];
  int n = kInvalid;
  if (x0_ok) {
    n = 0;
    bool done = false;
    const float ur = u[chain_uniform_resample(KD)];
    for (int i = 1; i <= KD && !done; ++i) {
      rp.x = vrow + size_t(i - 1) * V;
      rp.n_ex = i;
      DistCut p = build_dist<K>(rp, s, V, c);
      if (!p.valid) {
        n = kInvalid;
        break;
      }
      const int d = rp.ex[i];
      // A draft outside the vocabulary or an unusable draft row is only a
      // bad proposal: rejected, the token drawn from p.
      bool q_ok = d >= 0;
      DistCut q = p;
      if (q_ok) {
        rq.x = drow + size_t(i - 1) * V;
        rq.n_ex = i;
        q = build_dist<K>(rq, s, V, c);
        q_ok = q.valid;
      }
      if (q_ok) {
        const float pd = prob_of<K>(rp, s, p, d);
        const float qd = prob_of<K>(rq, s, q, d);
        const float ua = clamp_uniform<float>(u[i - 1], kOneBelowF);
        if (accepts_draft<float>(ua, qd, pd)) {
          out[i - 1] = d;
          n = i;
          continue;
        }
      }
      out[i - 1] = draw_rejected<K>(rp, s, p, rq, s, q, q_ok, ur, V, c);
      done = true;
    }
    if (n == KD) {
      rp.x = vrow + size_t(KD) * V;
      rp.n_ex = T;
      DistCut p = build_dist<K>(rp, s, V, c);
      if (p.valid) {
        out[KD] = draw_token<K>(
            rp, s, p, rp, s, p, false, u[chain_uniform_bonus(KD)], V, c);
      } else {
        n = kInvalid;
      }
    }
  }
  if (tid == 0) {
    write_chain_row(
        bundle + size_t(row) * (KD + 3),
        KD,
        x0_ok ? int(x0_raw) : kInvalid,
        n,
        out);
  }
}

} // namespace mtplx
