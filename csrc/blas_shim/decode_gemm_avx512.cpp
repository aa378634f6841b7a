// The decode GEMM for AVX-512F (compiled with -mavx512f -mavx512dq -mfma).
#if defined(__x86_64__)
#include "decode_gemm_kernel.h"

namespace mtplx::decode_detail {
namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 6;
  // R * C accumulators + C loads of B + one of A within 32 registers.
  static constexpr int cols(int r) {
    return r <= 2 ? 8 : (r <= 4 ? 6 : (r <= 6 ? 4 : 3));
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  }
  static __m128 hsum4(V a, V b, V c, V d) {
    const __m256 s = _mm256_hadd_ps(
        _mm256_hadd_ps(fold(a), fold(b)), _mm256_hadd_ps(fold(c), fold(d)));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  }
};

}  // namespace

void columns_avx512(const Args& g, int M, int n0, int n1) {
  columns<Avx512>(g, M, n0, n1);
}

}  // namespace mtplx::decode_detail
#endif  // __x86_64__
