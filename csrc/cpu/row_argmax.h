// CPU row argmax under the shared key rules (mtplx_rules.h), on 32-byte
// vectors (GCC/Clang vector extensions: SSE2 in the baseline build, AVX2 in
// the clone picked at load time).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "mtplx_rules.h"

namespace mtplx::cpu {

// Result of scanning one row: the winning index (or kInvalid) and validity.
struct RowArgmax {
  int index;
  bool valid;
};

// Lane-wise form of K::key: same formula, one 32-byte vector at a time.
template <class K>
struct KeyVec {
  using bits_t = typename K::bits_t;
  using key_t = std::make_signed_t<bits_t>;
  static constexpr int lanes = 32 / sizeof(bits_t);
  static constexpr key_t mag = std::numeric_limits<key_t>::max();
  typedef key_t vec __attribute__((vector_size(32)));

  static inline __attribute__((always_inline)) vec load_keys(const bits_t* p) {
    vec s;
    std::memcpy(&s, p, sizeof(vec));
    s &= ~((s & mag) == 0); // -0 -> +0
    return s ^ ((s >> (8 * sizeof(key_t) - 1)) & mag);
  }
};

// float32: one pass comparing floats directly, with per-lane first indices
// (a 600 KB row outgrows L2, so a second pass would go back to memory). For
// non-NaN values float order is the key order of mtplx_rules.h (-0 == +0);
// NaN is caught by x != x, and +Inf / all -Inf by the winning value.
inline __attribute__((always_inline)) RowArgmax
row_argmax_f32_impl(const float* x, int n) {
  typedef float vf __attribute__((vector_size(32)));
  typedef int32_t vi __attribute__((vector_size(32)));
  constexpr int L = 8;
  constexpr float inf = std::numeric_limits<float>::infinity();
  vf hi0 = vf{} - inf, hi1 = hi0;
  vi idx0 = vi{} + std::numeric_limits<int32_t>::max(), idx1 = idx0;
  vi nan0 = vi{}, nan1 = vi{};
  vi pos0, pos1;
  for (int j = 0; j < L; ++j) {
    pos0[j] = j;
    pos1[j] = L + j;
  }
  int i = 0;
  for (; i + 2 * L <= n; i += 2 * L, pos0 += 2 * L, pos1 += 2 * L) {
    vf v0, v1;
    std::memcpy(&v0, x + i, sizeof(vf));
    std::memcpy(&v1, x + i + L, sizeof(vf));
    vi gt0 = v0 > hi0; // strict: a lane keeps its first maximum
    vi gt1 = v1 > hi1;
    hi0 = gt0 ? v0 : hi0;
    hi1 = gt1 ? v1 : hi1;
    idx0 = gt0 ? pos0 : idx0;
    idx1 = gt1 ? pos1 : idx1;
    nan0 |= v0 != v0;
    nan1 |= v1 != v1;
  }
  float best = -inf;
  int best_idx = std::numeric_limits<int32_t>::max();
  bool has_nan = false;
  auto take = [&](float v, int k) {
    if (v > best || (v == best && k < best_idx)) {
      best = v;
      best_idx = k;
    }
  };
  for (int j = 0; j < L; ++j) {
    take(hi0[j], idx0[j]);
    take(hi1[j], idx1[j]);
    has_nan |= (nan0[j] | nan1[j]) != 0;
  }
  for (; i < n; ++i) {
    has_nan |= x[i] != x[i];
    take(x[i], i);
  }
  bool valid = !has_nan && best != inf && best != -inf;
  return {valid ? best_idx : kInvalid, valid};
}

// Two passes, for 16-bit keys: the extremes of the keys (pure lane-wise
// min/max, 16 lanes a vector), then the first position holding the maximum
// (stops early; the row is still in cache).
template <class K>
inline __attribute__((always_inline)) RowArgmax
row_argmax_two_pass(const typename K::bits_t* x, int n) {
  using KV = KeyVec<K>;
  using key_t = typename KV::key_t;
  using vec = typename KV::vec;
  constexpr int L = KV::lanes;

  vec hi0 = vec{} + std::numeric_limits<key_t>::min(), hi1 = hi0;
  vec lo0 = vec{} + std::numeric_limits<key_t>::max(), lo1 = lo0;
  int i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    vec k0 = KV::load_keys(x + i);
    vec k1 = KV::load_keys(x + i + L);
    hi0 = k0 > hi0 ? k0 : hi0;
    hi1 = k1 > hi1 ? k1 : hi1;
    lo0 = k0 < lo0 ? k0 : lo0;
    lo1 = k1 < lo1 ? k1 : lo1;
  }
  hi0 = hi1 > hi0 ? hi1 : hi0;
  lo0 = lo1 < lo0 ? lo1 : lo0;
  int max_key = hi0[0], min_key = lo0[0];
  for (int j = 1; j < L; ++j) {
    max_key = hi0[j] > max_key ? int(hi0[j]) : max_key;
    min_key = lo0[j] < min_key ? int(lo0[j]) : min_key;
  }
  for (int j = i; j < n; ++j) {
    int k = K::key(x[j]);
    max_key = k > max_key ? k : max_key;
    min_key = k < min_key ? k : min_key;
  }
  if (!row_is_valid(max_key, min_key, K::pos_inf(), K::neg_inf())) {
    return {kInvalid, false};
  }

  const vec target = vec{} + key_t(max_key);
  typedef uint64_t u64x4 __attribute__((vector_size(32)));
  int start = 0;
  for (; start + L <= n; start += L) {
    u64x4 hit = (u64x4)(KV::load_keys(x + start) == target);
    if (hit[0] | hit[1] | hit[2] | hit[3]) {
      break;
    }
  }
  for (int j = start; j < n; ++j) {
    if (K::key(x[j]) == max_key) {
      return {j, true};
    }
  }
  return {kInvalid, false}; // unreachable: the maximum is in the row
}

template <class K>
inline __attribute__((always_inline)) RowArgmax
row_argmax_16(const typename K::bits_t* x, int n) {
  static_assert(sizeof(typename K::bits_t) == 2);
  return row_argmax_two_pass<K>(x, n);
}

RowArgmax row_argmax_f32(const uint32_t* x, int n);
RowArgmax row_argmax_f16(const uint16_t* x, int n);
RowArgmax row_argmax_bf16(const uint16_t* x, int n);

} // namespace mtplx::cpu
