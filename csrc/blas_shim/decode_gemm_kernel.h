// The decode GEMM's loops (see decode_gemm.h), over a vector traits type T:
// V (the vector), kLanes, kMaxRows (rows per full tile), cols(R) (columns
// per tile of R rows), zero, load, fma and hsum4 (the lane sums of four
// vectors, each by a tree that does not depend on the other three).
// Included by one file per instruction set, compiled with that set enabled.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "decode_gemm.h"
#include "../cpu/prefetch_stream.h"

namespace mtplx::decode_detail {

// Bytes of B per column block: well inside one core's L2 next to A.
constexpr int64_t kBlockBytes = 256 * 1024;

// The next column block of B is prefetched into L1 (cpu/prefetch_stream.h).
using Prefetch = PrefetchStream<3>;

// Rows [i0, i0 + R) x columns [n, n + C): full-K dot products, stored.
template <class T, int R, int C>
inline void tile(const Args& g, int i0, int n, Prefetch& pf) {
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
    pf.step();
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
inline void row_tile(const Args& g, int i0, int n0, int n1, Prefetch& pf) {
  constexpr int C = T::cols(R);
  int n = n0;
  for (; n + C <= n1; n += C) tile<T, R, C>(g, i0, n, pf);
  for (; n < n1; ++n) tile<T, R, 1>(g, i0, n, pf);
}

// Rows [i0, i0 + r) against columns [n0, n1), for a run-time r <= kMaxRows.
template <class T, int R = T::kMaxRows>
inline void row_tile_of(
    const Args& g,
    int r,
    int i0,
    int n0,
    int n1,
    Prefetch& pf) {
  if constexpr (R >= 1) {
    if (r == R) {
      row_tile<T, R>(g, i0, n0, n1, pf);
    } else {
      row_tile_of<T, R - 1>(g, r, i0, n0, n1, pf);
    }
  }
}

// Columns [n0, n1) for rows [0, M): block by block, each block against every
// row tile. The rows are cut into as few tiles as kMaxRows allows, of sizes
// as even as possible: each tile reads the block once more from L2.
template <class T>
inline void columns(const Args& g, int M, int n0, int n1) {
  constexpr int R = T::kMaxRows;
  const int64_t row_bytes = int64_t(g.K) * 4;
  int64_t block = kBlockBytes / row_bytes;
  block = block < kDecodeSplitAlign
      ? kDecodeSplitAlign
      : block / kDecodeSplitAlign * kDecodeSplitAlign;
  const int tiles = (M + R - 1) / R;
  const int rows = M / tiles, extra = M % tiles;  // `extra` tiles get one more
  // Vector steps per block (about): row tiles x column tiles x K steps.
  const int64_t steps = int64_t(tiles) *
      ((block + T::cols(rows) - 1) / T::cols(rows)) * (g.K / T::kLanes + 1);
  Prefetch pf;
  for (int b0 = n0; b0 < n1; b0 += int(block)) {
    const int b1 = b0 + block < n1 ? b0 + int(block) : n1;
    const int b2 = b1 + block < n1 ? b1 + int(block) : n1;
    // One or two rows only stream B: nothing to overlap the next block with.
    if (M > 2) {
      pf.aim(
          reinterpret_cast<const char*>(g.b + int64_t(b1) * g.ldb),
          reinterpret_cast<const char*>(g.b + int64_t(b2) * g.ldb),
          steps);
    }
    for (int t = 0, i = 0; t < tiles; ++t) {
      const int r = rows + (t < extra);
      row_tile_of<T>(g, r, i, b0, b1, pf);
      i += r;
    }
  }
}

}  // namespace mtplx::decode_detail
