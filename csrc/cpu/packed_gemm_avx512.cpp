// The packed GEMM for AVX-512F (compiled with -mavx512f -mfma): tiles of up
// to 8 rows x 3 vectors of 16 columns, 24 accumulators in 32 registers.
#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu/packed_gemm_kernel.h"

namespace mtplx::cpu::packed_detail {
namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRows = kRowsAvx512;
  static constexpr int kCols = 3;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};

} // namespace

void panels_avx512(const Call& c, int p0, int p1) {
  panels<Avx512>(c, p0, p1);
}

} // namespace mtplx::cpu::packed_detail
#endif
