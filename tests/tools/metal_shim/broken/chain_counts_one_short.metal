// Test fixture, deliberately broken: verify_sampled_chain builds the target
// p_i with the counts of x0, d_1..d_{i-2} (one draft short), so penalised
// rows commit wrong tokens.
// A copy of the sampled kernel of metal/chain.h with one change; the
// emulator tests must catch it. Never built into the metallib.
#include <metal_stdlib>

#include "mtplx_rules.h"
#include "sampling.h"
#include "verify_greedy.h"

using namespace metal;

namespace mtplx {

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

// verify_logits [B, K + 1, V] and draft_logits [B, K, V] bits; tokens
// [B, K + 1]; uniforms [B, K + 2]; params [B, kParamCols]; counts [B, V]
// (bound when has_counts); bundle [B, K + 3].
template <typename K, typename TokT>
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
  rp.bias = params; // no bias: never read
  rp.has_bias = false;
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
      rp.n_ex = i - 1; // BROKEN: should be i
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
      int t = kInvalid;
      if (q_ok) {
        t = draw_token<K>(rp, s, p, rq, s, q, true, ur, V, c);
      }
      if (t == kInvalid) {
        // No residual mass (p == q up to rounding) or no usable q: from p.
        t = draw_token<K>(rp, s, p, rp, s, p, false, ur, V, c);
      }
      out[i - 1] = t;
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

template [[host_name("verify_sampled_chain_float32_int32")]] [[kernel]]
decltype(mtplx::verify_sampled_chain<mtplx::F32Key, int>)
    mtplx::verify_sampled_chain<mtplx::F32Key, int>;
