// C = alpha * A B^T + beta * C for float32 row-major A [M, K] and B [N, K]
// with few rows M (at most kSmallGemmMaxRows): B is read once, straight from
// memory, with no packing; tiles of M rows of A x 2-4 rows of B keep up to
// 12 8-lane accumulators in registers. x86-64 only, compiled for AVX2 + FMA
// and used only where the CPU has both (elsewhere OpenBLAS does everything). Each
// output is one K-ordered dot product whatever M is, so a row's result does
// not depend on the other rows of the call.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define MTPLX_SMALL_GEMM 1
#define MTPLX_GEMM_TARGET __attribute__((target("avx2,fma")))
#else
#define MTPLX_SMALL_GEMM 0
#define MTPLX_GEMM_TARGET
#endif
#define MTPLX_GEMM_INLINE inline __attribute__((always_inline)) MTPLX_GEMM_TARGET

namespace mtplx {

// CBLAS enums: CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112.
// Up to this many rows the small kernel beats OpenBLAS's sgemm on every
// decode shape measured (K 192-576, N 64-2048; 1.3-4x); at 8 rows it is even.
constexpr int kSmallGemmMaxRows = 8;

inline bool cpu_has_avx2_fma() {
#if MTPLX_SMALL_GEMM
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// max_rows: the caller's limit (kSmallGemmMaxRows by default, 0 = off).
inline bool small_gemm_applies(
    int order, int ta, int tb, int m, int n, int k, int max_rows) {
  return order == 101 && ta == 111 && tb == 112 && m >= 1 &&
      m <= max_rows && n >= 1 && k >= 1 && cpu_has_avx2_fma();
}

namespace gemm_detail {

typedef float vf8 __attribute__((vector_size(32)));

MTPLX_GEMM_INLINE vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef float vf4 __attribute__((vector_size(16)));

// Pairwise sums of adjacent lanes of x and y, interleaved per 128-bit half
// (what AVX's hadd does).
MTPLX_GEMM_INLINE vf8 hadd8(vf8 x, vf8 y) {
  return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
      __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}

// The lane sums of four vectors at once: [sum a, sum b, sum c, sum d]. One
// horizontal sum at a time costs more than a tile's K loop at K = 192.
MTPLX_GEMM_INLINE vf4 hsum4x8(vf8 a, vf8 b, vf8 c, vf8 d) {
  const vf8 s = hadd8(hadd8(a, b), hadd8(c, d));
  return __builtin_shufflevector(s, s, 0, 1, 2, 3) +
      __builtin_shufflevector(s, s, 4, 5, 6, 7);
}

// out[i][j] = sum_k a[i, k] b[j, k] for R rows of a and C rows of b.
template <int R, int C>
MTPLX_GEMM_INLINE void tile(
    const float* a,
    int64_t lda,
    const float* b,
    int64_t ldb,
    int K,
    float out[R][C]) {
  vf8 acc[R][C] = {};
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    vf8 w[C];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      w[j] = load8(b + j * ldb + k);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const vf8 x = load8(a + i * lda + k);
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) {
        acc[i][j] += x * w[j];
      }
    }
  }
  // Lane sums four accumulators at a time (row-major over the tile).
  constexpr int kAcc = R * C;
  float sums[(kAcc + 3) / 4 * 4];
#pragma GCC unroll 4
  for (int g = 0; g < kAcc; g += 4) {
    const vf8 z = {};
    auto at = [&](int q) { return q < kAcc ? acc[q / C][q % C] : z; };
    const vf4 v = hsum4x8(at(g), at(g + 1), at(g + 2), at(g + 3));
    std::memcpy(sums + g, &v, sizeof(v));
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      float r = sums[i * C + j];
      for (int t = k; t < K; ++t) {
        r += a[i * lda + t] * b[j * ldb + t];
      }
      out[i][j] = r;
    }
  }
}

template <int R, int C>
MTPLX_GEMM_INLINE void tile_store(
    const float* a,
    int64_t lda,
    const float* b,
    int64_t ldb,
    int K,
    float alpha,
    float beta,
    float* c,
    int64_t ldc) {
  float out[R][C];
  tile<R, C>(a, lda, b, ldb, K, out);
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < C; ++j) {
      float v = alpha * out[i][j];
      // beta == 0 must not read C (it may hold anything, NaN included).
      c[i * ldc + j] = beta == 0.0f ? v : v + beta * c[i * ldc + j];
    }
  }
}

// Columns per tile for R rows: at most 12 accumulators (of 16 registers).
template <int R>
constexpr int kCols = R <= 3 ? 4 : (R == 4 ? 3 : (R <= 6 ? 2 : 1));

// All R rows of A against B in one pass: B is read from memory once.
template <int R>
MTPLX_GEMM_TARGET void rows(
    int N,
    int K,
    float alpha,
    const float* a,
    int64_t lda,
    const float* b,
    int64_t ldb,
    float beta,
    float* c,
    int64_t ldc) {
  constexpr int C = kCols<R>;
  int n = 0;
  for (; n + C <= N; n += C) {
    tile_store<R, C>(a, lda, b + n * ldb, ldb, K, alpha, beta, c + n, ldc);
  }
  for (; n < N; ++n) {
    tile_store<R, 1>(a, lda, b + n * ldb, ldb, K, alpha, beta, c + n, ldc);
  }
}

} // namespace gemm_detail

MTPLX_GEMM_TARGET static void small_gemm_nt(
    int M,
    int N,
    int K,
    float alpha,
    const float* a,
    int lda,
    const float* b,
    int ldb,
    float beta,
    float* c,
    int ldc) {
  using namespace gemm_detail;
  using Rows = void (*)(
      int, int, float, const float*, int64_t, const float*, int64_t, float,
      float*, int64_t);
  static constexpr Rows kRows[kSmallGemmMaxRows] = {
      rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};
  kRows[M - 1](N, K, alpha, a, lda, b, ldb, beta, c, ldc);
}

} // namespace mtplx
