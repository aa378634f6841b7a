// The packed GEMM's loops (see packed_gemm.h) over a vector traits type T:
// V (the vector), kLanes, kRows (rows per full tile), kCols (vectors per
// tile of columns; kLanes * kCols divides kPackedPanel), zero, load, store,
// set1, fma. Included by one file per instruction set, compiled with that
// set enabled.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/packed_gemm.h"
#include "cpu/prefetch_stream.h"

namespace mtplx::cpu::packed_detail {

// The weight is one sequential stream (panels are contiguous, and so are a
// thread's panels): while a chunk is computed, the stream kPrefetchAhead
// bytes further on is prefetched into L2, spread evenly over the chunk's
// vector steps (cpu/prefetch_stream.h). A short, steady distance keeps
// memory busy the whole time at every row count, one row included, without
// crowding L2; aiming at the whole next panel instead (up to 864 KiB at
// K = 4608, beside the x block) measured 5-15 % slower at 1 to 40 rows.
using Prefetch = PrefetchStream<2>;
constexpr int64_t kPrefetchAhead = 64 * 1024;

// A panel's k range is cut into chunks of at most this many k (48 KiB of
// the panel): every row tile after the first reads the chunk again, from L2
// at worst; small chunks keep the prefetch distance short.
constexpr int kKChunk = 256;

// Rows [i0, i0 + R) (one row tile) x the kCols vectors of columns at `col`
// of one panel, k in [k0, k1): acc[i][j] += x[i0 + i, k] * w[k, col + j *
// kLanes], k in order, starting from zero at k0 = 0 and from `out` (the
// previous chunk's sums, stored as float32: the chain goes on unchanged)
// after.
template <class T, int R>
inline void tile(
    const Call& c,
    int64_t i0,
    const float* panel,
    int col,
    int k0,
    int k1,
    float* out,
    int64_t ldo,
    Prefetch& pf) {
  using V = typename T::V;
  constexpr int C = T::kCols;
  constexpr int L = T::kLanes;
  V acc[R][C];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      acc[i][j] = k0 == 0 ? T::zero() : T::load(out + i * ldo + j * L);
    }
  }
  const float* xt = c.xt + i0 * c.K + int64_t(k0) * R;  // the tile's block
  const float* w = panel + int64_t(k0) * kPackedPanel + col;
  for (int k = k0; k < k1; ++k) {
    pf.step();
    V wv[C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) wv[j] = T::load(w + j * L);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const V xv = T::set1(xt[i]);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[i][j] = T::fma(xv, wv[j], acc[i][j]);
    }
    xt += R;
    w += kPackedPanel;
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) T::store(out + i * ldo + j * L, acc[i][j]);
  }
}

// A run-time row count r in [1, T::kRows] to the tile for it.
template <class T, int R = T::kRows>
inline void tile_of(
    int r,
    const Call& c,
    int64_t i0,
    const float* panel,
    int col,
    int k0,
    int k1,
    float* out,
    int64_t ldo,
    Prefetch& pf) {
  if constexpr (R >= 1) {
    if (r == R) {
      tile<T, R>(c, i0, panel, col, k0, k1, out, ldo, pf);
    } else {
      tile_of<T, R - 1>(r, c, i0, panel, col, k0, k1, out, ldo, pf);
    }
  }
}

// Panels [p0, p1) for every row: panel by panel, each against every row
// tile (RowTiles). A panel's last columns beyond N go to a scratch tile.
template <class T>
inline void panels(const Call& c, int p0, int p1) {
  constexpr int R = T::kRows;
  constexpr int W = T::kLanes * T::kCols;  // columns per column tile
  static_assert(kPackedPanel % W == 0);
  const int64_t panel_floats = int64_t(c.K) * kPackedPanel;
  const RowTiles rt(c.M, R);
  const int64_t tiles = rt.count;
  if (tiles == 0) {
    return;
  }
  const char* stream_end =
      reinterpret_cast<const char*>(c.wp + p1 * panel_floats);
  // The last panel's tiles when it is partial: every row tile's sums
  // survive between k chunks (rows <= 64: at most 64 x 48 floats).
  alignas(64) float scratch[64 * kPackedPanel];
  Prefetch pf;
  for (int p = p0; p < p1; ++p) {
    const float* panel = c.wp + p * panel_floats;
    const int n0 = p * kPackedPanel;
    const bool full = n0 + kPackedPanel <= c.N;
    for (int k0 = 0; k0 < c.K; k0 += kKChunk) {
      const int k1 = std::min(c.K, k0 + kKChunk);
      const char* here =
          reinterpret_cast<const char*>(panel + int64_t(k0) * kPackedPanel);
      const int64_t bytes = int64_t(k1 - k0) * kPackedPanel * 4;
      const int64_t left = stream_end - here;  // to the end of the thread's panels
      pf.aim(
          here + std::min(kPrefetchAhead, left),
          here + std::min(kPrefetchAhead + bytes, left),
          tiles * (kPackedPanel / W) * int64_t(k1 - k0));
      for (int64_t t = 0; t < tiles; ++t) {
        const int r = int(rt.size(t));
        const int64_t i0 = rt.start(t);
        float* dst =
            full ? c.y + i0 * c.N + n0 : scratch + t * R * kPackedPanel;
        const int64_t ld = full ? c.N : kPackedPanel;
        for (int col = 0; col < kPackedPanel; col += W) {
          if (full || n0 + col < c.N) {
            tile_of<T>(r, c, i0, panel, col, k0, k1, dst + col, ld, pf);
          }
        }
      }
    }
    if (!full) {  // the last panel's valid columns, from its scratch tiles
      const int valid = c.N - n0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int r = int(rt.size(t));
        const int64_t i0 = rt.start(t);
        for (int i = 0; i < r; ++i) {
          std::memcpy(
              c.y + (i0 + i) * c.N + n0,
              scratch + (t * R + i) * kPackedPanel,
              sizeof(float) * valid);
        }
      }
    }
  }
}

} // namespace mtplx::cpu::packed_detail
