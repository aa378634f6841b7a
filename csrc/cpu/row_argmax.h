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

// One pass with per-lane first indices, for 32-bit keys (rows of 4-byte
// logits often outgrow L2, so a second pass would go back to memory).
template <class K>
inline __attribute__((always_inline)) RowArgmax
row_argmax_one_pass(const typename K::bits_t* x, int n) {
  using KV = KeyVec<K>;
  using vec = typename KV::vec;
  constexpr int L = KV::lanes;
  static_assert(sizeof(typename KV::key_t) == 4);

  vec hi = vec{} + std::numeric_limits<int32_t>::min();
  vec lo = vec{} + std::numeric_limits<int32_t>::max();
  vec idx = vec{} + std::numeric_limits<int32_t>::max();
  vec pos;
  for (int j = 0; j < L; ++j) {
    pos[j] = j;
  }
  int i = 0;
  for (; i + L <= n; i += L, pos += L) {
    vec k = KV::load_keys(x + i);
    vec gt = k > hi; // strict: a lane keeps its first maximum
    hi = gt ? k : hi;
    idx = gt ? pos : idx;
    lo = k < lo ? k : lo;
  }
  int max_key = hi[0], best = idx[0], min_key = lo[0];
  for (int j = 1; j < L; ++j) {
    if (takes_over(hi[j], idx[j], max_key, best)) {
      max_key = hi[j];
      best = idx[j];
    }
    min_key = lo[j] < min_key ? int(lo[j]) : min_key;
  }
  for (; i < n; ++i) {
    int k = K::key(x[i]);
    if (k > max_key) {
      max_key = k;
      best = i;
    }
    min_key = k < min_key ? k : min_key;
  }
  bool valid = row_is_valid(max_key, min_key, K::pos_inf(), K::neg_inf());
  return {valid ? best : kInvalid, valid};
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
row_argmax_impl(const typename K::bits_t* x, int n) {
  if constexpr (sizeof(typename K::bits_t) == 4) {
    return row_argmax_one_pass<K>(x, n);
  } else {
    return row_argmax_two_pass<K>(x, n);
  }
}

RowArgmax row_argmax_f32(const uint32_t* x, int n);
RowArgmax row_argmax_f16(const uint16_t* x, int n);
RowArgmax row_argmax_bf16(const uint16_t* x, int n);

} // namespace mtplx::cpu
