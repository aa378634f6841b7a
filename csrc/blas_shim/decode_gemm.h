// C = alpha * A B^T + beta * C for float32 row-major A [M, K] (1 to
// kDecodeGemmMaxRows rows: the tokens of a decode or verification step) and
// B [N, K] (a Linear layer's weight), the product every decode-time Linear
// layer asks for.
//
// B is streamed from memory once per call whatever M is, with no packing:
// the columns are cut into blocks of about 256 KiB of B, and every row tile
// of A runs against a block while it sits in L2 (A itself, a few rows of
// activations, stays cache-resident) while software prefetches bring in the
// next block. The rows are cut into as few tiles as the registers allow, of
// even sizes (8 rows: two tiles of 4, not 6 + 2), since every tile reads the
// block from L2 once more. Within a block a tile of R rows of A x
// C rows of B keeps R * C vector accumulators in registers, so each load of
// B feeds R FMAs and each load of A feeds C.
//
// Every output element is one dot product in a fixed order (vector lanes
// over K, then a fixed lane-sum tree, then the scalar tail of K, all with
// explicit FMAs), whatever the tile it falls in: a row's result does not
// depend on the other rows of the call nor on how the columns are split
// between threads. Large B splits its columns over two threads (the caller
// and one worker, see blas_shim.cpp), which lets a step read its weights at
// more than one core's read rate.
//
// x86-64 only: AVX-512F where the CPU has it (up to 6 x 4 or 4 x 6 tiles of 16 lanes
// in 32 registers, decode_gemm_avx512.cpp), else AVX2 + FMA (up to 4 x 2
// tiles of 8 lanes in 16 registers, decode_gemm_avx2.cpp). Each file is
// compiled for its own instruction set; this header only dispatches.
#pragma once

#include <cstdint>

#include "small_gemm.h"

namespace mtplx {

// Most rows of A the kernel takes; more rows (prefill) go to OpenBLAS.
constexpr int kDecodeGemmMaxRows = 64;

// Column granularity of a thread split: whole tiles of every width.
constexpr int kDecodeSplitAlign = 24;

namespace decode_detail {

struct Args {
  int N, K;
  float alpha, beta;
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
};

// Columns [n0, n1) of the product for rows [0, M).
void columns_avx512(const Args& g, int M, int n0, int n1);
void columns_avx2(const Args& g, int M, int n0, int n1);

}  // namespace decode_detail

inline bool cpu_has_avx512f() {
#if MTPLX_SMALL_GEMM
  static const bool has = __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512dq") && cpu_has_avx2_fma();
  return has;
#else
  return false;
#endif
}

// Columns [n0, n1) of C = alpha * A B^T + beta * C for M rows; the shim
// splits [0, N) between threads and calls this once per part. Requires
// cpu_has_avx2_fma().
inline void decode_gemm_columns(
    int M,
    int n0,
    int n1,
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
#if MTPLX_SMALL_GEMM
  const decode_detail::Args g{N, K, alpha, beta, a, lda, b, ldb, c, ldc};
  if (cpu_has_avx512f()) {
    decode_detail::columns_avx512(g, M, n0, n1);
  } else {
    decode_detail::columns_avx2(g, M, n0, n1);
  }
#endif
}

}  // namespace mtplx
