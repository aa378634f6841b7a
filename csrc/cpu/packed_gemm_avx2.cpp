// The packed GEMM for AVX2 + FMA (compiled with -mavx2 -mfma): tiles of up
// to 4 rows x 3 vectors of 8 columns, 12 accumulators in 16 registers.
#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu/packed_gemm_kernel.h"

namespace mtplx::cpu::packed_detail {
namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRows = kRowsAvx2;
  static constexpr int kCols = 3;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};

} // namespace

void panels_avx2(const Call& c, int p0, int p1) {
  panels<Avx2>(c, p0, p1);
}

} // namespace mtplx::cpu::packed_detail
#endif
