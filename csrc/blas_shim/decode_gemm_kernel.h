// The decode GEMM's loops (see decode_gemm.h), over a vector traits type T:
// V (the vector), kLanes, kMaxRows (rows per full tile), cols(R) (columns
// per tile of R rows), zero, load, fma and hsum4 (the lane sums of four
// vectors, each by a tree that does not depend on the other three).
// Included by one file per instruction set, compiled with that set enabled.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "decode_gemm.h"

namespace mtplx::decode_detail {

// Bytes of B per column block: well inside one core's L2 next to A.
constexpr int64_t kBlockBytes = 256 * 1024;

// Rows [i0, i0 + R) x columns [n, n + C): full-K dot products, stored.
template <class T, int R, int C>
inline void tile(const Args& g, int i0, int n) {
  using V = typename T::V;
  constexpr int L = T::kLanes;
  const float* a = g.a + i0 * g.lda;
  const float* b = g.b + n * g.ldb;
  V acc[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[i][j] = T::zero();
  }
  int k = 0;
  for (; k + L <= g.K; k += L) {
    V w[C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) w[j] = T::load(b + j * g.ldb + k);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const V x = T::load(a + i * g.lda + k);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[i][j] = T::fma(x, w[j], acc[i][j]);
    }
  }
  constexpr int kAcc = R * C;
  alignas(16) float sums[(kAcc + 3) / 4 * 4];
#pragma GCC unroll 12
  for (int q = 0; q < kAcc; q += 4) {
    auto at = [&](int p) { return p < kAcc ? acc[p / C][p % C] : T::zero(); };
    _mm_store_ps(sums + q, T::hsum4(at(q), at(q + 1), at(q + 2), at(q + 3)));
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      float r = sums[i * C + j];
      for (int t = k; t < g.K; ++t) {
        r = __builtin_fmaf(a[i * g.lda + t], b[j * g.ldb + t], r);
      }
      float* out = g.c + (i0 + i) * g.ldc + n + j;
      const float v = g.alpha * r;
      // beta == 0 must not read C (it may hold anything, NaN included).
      *out = g.beta == 0.0f ? v : __builtin_fmaf(g.beta, *out, v);
    }
  }
}

// Rows [i0, i0 + R) against columns [n0, n1).
template <class T, int R>
inline void row_tile(const Args& g, int i0, int n0, int n1) {
  constexpr int C = T::cols(R);
  int n = n0;
  for (; n + C <= n1; n += C) tile<T, R, C>(g, i0, n);
  for (; n < n1; ++n) tile<T, R, 1>(g, i0, n);
}

// Columns [n0, n1) for rows [0, M): block by block, each block against every
// row tile (kMaxRows rows at a time, then one tile of the rest).
template <class T>
inline void columns(const Args& g, int M, int n0, int n1) {
  constexpr int R = T::kMaxRows;
  const int64_t row_bytes = int64_t(g.K) * 4;
  int64_t block = kBlockBytes / row_bytes;
  block = block < kDecodeSplitAlign
      ? kDecodeSplitAlign
      : block / kDecodeSplitAlign * kDecodeSplitAlign;
  for (int b0 = n0; b0 < n1; b0 += int(block)) {
    const int b1 = b0 + block < n1 ? b0 + int(block) : n1;
    int i = 0;
    for (; i + R <= M; i += R) row_tile<T, R>(g, i, b0, b1);
    switch (M - i) {
      case 1: row_tile<T, 1>(g, i, b0, b1); break;
      case 2: row_tile<T, 2>(g, i, b0, b1); break;
      case 3: row_tile<T, 3>(g, i, b0, b1); break;
      case 4: if constexpr (R > 4) row_tile<T, 4>(g, i, b0, b1); break;
      case 5: if constexpr (R > 5) row_tile<T, 5>(g, i, b0, b1); break;
      default: break;
    }
  }
}

}  // namespace mtplx::decode_detail
