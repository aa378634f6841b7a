// CPU row argmax under the shared key rules (mtplx_rules.h), written as
// independent lanes so that the compiler vectorises the hot loop.
#pragma once

#include <climits>
#include <cstdint>

#include "mtplx_rules.h"

namespace mtplx::cpu {

// Result of scanning one row: the winning index (or kInvalid) and validity.
struct RowArgmax {
  int index;
  bool valid;
};

template <class K>
inline __attribute__((always_inline)) RowArgmax
row_argmax_impl(const typename K::bits_t* x, int n) {
  constexpr int L = 16;
  int best_key[L], best_idx[L], min_key[L];
  for (int j = 0; j < L; ++j) {
    best_key[j] = INT_MIN;
    best_idx[j] = INT_MAX;
    min_key[j] = INT_MAX;
  }
  int i = 0;
  for (; i + L <= n; i += L) {
    for (int j = 0; j < L; ++j) {
      int k = K::key(x[i + j]);
      bool gt = k > best_key[j]; // strict: the first occurrence stays
      best_key[j] = gt ? k : best_key[j];
      best_idx[j] = gt ? i + j : best_idx[j];
      min_key[j] = k < min_key[j] ? k : min_key[j];
    }
  }
  for (int j = 0; i + j < n; ++j) {
    int k = K::key(x[i + j]);
    bool gt = k > best_key[j];
    best_key[j] = gt ? k : best_key[j];
    best_idx[j] = gt ? i + j : best_idx[j];
    min_key[j] = k < min_key[j] ? k : min_key[j];
  }
  int bk = best_key[0], bi = best_idx[0], mk = min_key[0];
  for (int j = 1; j < L; ++j) {
    if (takes_over(best_key[j], best_idx[j], bk, bi)) {
      bk = best_key[j];
      bi = best_idx[j];
    }
    mk = min_key[j] < mk ? min_key[j] : mk;
  }
  bool valid = row_is_valid(bk, mk, K::pos_inf(), K::neg_inf());
  return {valid ? bi : kInvalid, valid};
}

RowArgmax row_argmax_f32(const uint32_t* x, int n);
RowArgmax row_argmax_f16(const uint16_t* x, int n);
RowArgmax row_argmax_bf16(const uint16_t* x, int n);

} // namespace mtplx::cpu
