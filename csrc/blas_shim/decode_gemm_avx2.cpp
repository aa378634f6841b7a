// The decode GEMM for AVX2 + FMA (compiled with -mavx2 -mfma).
#if defined(__x86_64__)
#include "decode_gemm_kernel.h"

namespace mtplx::decode_detail {
namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxRows = 4;
  // R * C accumulators + C loads of B + one of A within 16 registers.
  static constexpr int cols(int r) { return r <= 2 ? 4 : 2; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static __m128 hsum4(V a, V b, V c, V d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  }
};

}  // namespace

void columns_avx2(const Args& g, int M, int n0, int n1) {
  columns<Avx2>(g, M, n0, n1);
}

}  // namespace mtplx::decode_detail
#endif  // __x86_64__
