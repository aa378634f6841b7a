// Numeric rules shared by the CPU kernels (csrc/) and the Metal kernels
// (metal/). Anything that decides a token lives here so both paths agree bit
// for bit.
//
// Token choice works on an order-preserving integer key of the logit's bits:
//   * the largest key wins; ties go to the lowest index (as mx.argmax);
//   * -0 and +0 share one key (they compare equal as floats);
//   * a row is invalid when it holds a NaN (either sign) or +Inf, or has no
//     finite logit at all (every entry -Inf): the bundle then says accept = -1.
#pragma once

#ifdef __METAL_VERSION__
#define MTPLX_FN inline
// static constexpr: one private copy per .air file, so the metallib links.
#define MTPLX_CONST static constant constexpr
#else
#include <cstdint>
#define MTPLX_FN inline constexpr
#define MTPLX_CONST constexpr
#endif

namespace mtplx {

#ifndef __METAL_VERSION__
using uint = uint32_t;
using ushort = uint16_t;
#endif

// Bundle layout: one int32 row of kBundleCols per stream.
MTPLX_CONST int kBundleCols = 5;
MTPLX_CONST int kColX0 = 0;
MTPLX_CONST int kColDraft = 1;
MTPLX_CONST int kColSecond = 2; // x1 (greedy) or the committed second token
MTPLX_CONST int kColAccept = 3;
MTPLX_CONST int kColBonus = 4;
// accept / token value for a row that must not be used.
MTPLX_CONST int kInvalid = -1;

// Ordered keys. The arithmetic shift flips the magnitude bits of negative
// values so that signed integer order equals float order.
struct F32Key {
  using bits_t = uint;
  static MTPLX_FN int key(uint bits) {
    bits = (bits & 0x7FFFFFFFu) == 0u ? 0u : bits;
    int s = int(bits);
    return s ^ ((s >> 31) & 0x7FFFFFFF);
  }
  static MTPLX_FN int pos_inf() {
    return 0x7F800000;
  }
  static MTPLX_FN int neg_inf() {
    return int(0x807FFFFFu); // key(0xFF800000)
  }
};

template <int PosInfBits>
struct Half16Key {
  using bits_t = ushort;
  static MTPLX_FN int key(ushort bits) {
    bits = (bits & 0x7FFF) == 0 ? ushort(0) : bits;
    int s = int(short(bits));
    return s ^ ((s >> 15) & 0x7FFF);
  }
  static MTPLX_FN int pos_inf() {
    return PosInfBits;
  }
  static MTPLX_FN int neg_inf() {
    return -PosInfBits - 1; // key(PosInfBits | 0x8000)
  }
};

using F16Key = Half16Key<0x7C00>;
using BF16Key = Half16Key<0x7F80>;

// The largest key of a row and its smallest key decide whether it is usable.
MTPLX_FN bool row_is_valid(int max_key, int min_key, int pos_inf, int neg_inf) {
  return max_key < pos_inf && min_key >= neg_inf && max_key > neg_inf;
}

// Argmax combine: larger key wins, ties go to the lower index.
MTPLX_FN bool takes_over(int key, int idx, int best_key, int best_idx) {
  return key > best_key || (key == best_key && idx < best_idx);
}

// ---- Sampling (python/mtplx_ext/sampling/reference.py documents the full definition).
// CPU kernels instantiate these with double, Metal kernels with float.

// Packed per-row sampler parameters: [B, kParamCols] float32.
MTPLX_CONST int kParamCols = 7;
MTPLX_CONST int kParamTemperature = 0;
MTPLX_CONST int kParamTopK = 1;
MTPLX_CONST int kParamTopP = 2;
MTPLX_CONST int kParamMinP = 3;
MTPLX_CONST int kParamPresence = 4;
MTPLX_CONST int kParamFrequency = 5;
MTPLX_CONST int kParamRepetition = 6;

// Uniforms of verify_sampled: [B, kUniformCols] float32.
MTPLX_CONST int kUniformCols = 3;
MTPLX_CONST int kUniformAccept = 0;
MTPLX_CONST int kUniformResample = 1;
MTPLX_CONST int kUniformBonus = 2;

// Penalty counts: a negative count acts as 0, and adding the occurrences of
// tokens inside the cycle saturates at the largest int32 (a count wrapping
// negative would silently switch the penalties off).
MTPLX_CONST int kMaxCount = 2147483647;
MTPLX_FN int penalty_count(int count, int extra) {
  count = count > 0 ? count : 0;
  return extra > kMaxCount - count ? kMaxCount : count + extra;
}

// Penalties on a raw logit seen `count` times: repetition first (divide a
// positive logit, multiply a negative one), then frequency and presence.
template <typename T>
MTPLX_FN T penalised_logit(T l, int count, T presence, T frequency, T rep) {
  if (count <= 0) {
    return l;
  }
  l = l > T(0) ? l / rep : l * rep;
  return l - (frequency * T(count) + presence);
}

// Uniforms are used in [0, 1): NaN and negatives act as 0, values >= 1 as
// `one_below` (the largest value below 1 of T).
template <typename T>
MTPLX_FN T clamp_uniform(T u, T one_below) {
  return u >= T(0) ? (u < T(1) ? u : one_below) : T(0);
}

// Speculative acceptance with probability min(1, p_d / q_d); q_d == 0
// accepts exactly when p_d > 0, and p_d == 0 never accepts (even u == 0).
template <typename T>
MTPLX_FN bool accepts_draft(T u, T q_d, T p_d) {
  return u * q_d < p_d;
}

// ---- Depth-K chains (verify_greedy_chain / verify_sampled_chain).
// Bundle [B, K + 3]: x0, n (accepted drafts, or kInvalid), then the K + 1
// committed tokens c_1..c_{K+1} (kInvalid past c_{n+1}).
MTPLX_CONST int kMaxChainDrafts = 8;
MTPLX_CONST int kChainColX0 = 0;
MTPLX_CONST int kChainColAccepted = 1;
MTPLX_CONST int kChainColFirst = 2;
// Tokens a position of the chain counts on top of the counts: x0, d_1..d_K.
MTPLX_CONST int kMaxExtraTokens = kMaxChainDrafts + 1;
// Uniforms of verify_sampled_chain: [B, K + 2] = u_accept_1..K, u_resample,
// u_bonus.
MTPLX_FN int chain_uniform_resample(int k) {
  return k;
}
MTPLX_FN int chain_uniform_bonus(int k) {
  return k + 1;
}

// Top-k length of the kept prefix: top_k in (0, V) keeps top_k tokens.
MTPLX_FN int top_k_length(int top_k, int vocab) {
  return (top_k > 0 && top_k < vocab) ? top_k : vocab;
}

} // namespace mtplx
