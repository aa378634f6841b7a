// The quantized packed GEMM for AVX-512 VNNI (compiled with -mavx512f
// -mavx512bw -mavx512vnni): one vpdpbusd adds 4 products to each of 16
// columns; tiles of up to 4 rows x 4 blocks, 16 integer accumulators.
#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu/qgemm_avx512_traits.h"

namespace mtplx::cpu::qgemm_detail {

MTPLX_QGEMM_INSTANTIATE(panels_avx512, Avx512Vnni)

// quantize_row_generic's operations, one zmm of 16 lanes (qgemm.cpp).
void quantize_row_avx512(
    const float* x,
    int K,
    int group_size,
    int bits,
    int8_t* xq,
    RowGroup* rg) {
  static_assert(kQuantLanes == 16);
  const __m512 zero = _mm512_setzero_ps();
  const __m512 magic = _mm512_set1_ps(kRoundMagic);
  for (int g = 0, k0 = 0; k0 < K; ++g, k0 += group_size) {
    const float* xg = x + k0;
    __m512 amax = zero, sum = zero, nonfinite = zero;
    for (int k = 0; k < group_size; k += 16) {
      const __m512 v = _mm512_loadu_ps(xg + k);
      // max_ps returns its second operand when one is NaN: amax stays.
      amax = _mm512_max_ps(_mm512_abs_ps(v), amax);
      sum = _mm512_add_ps(sum, v);
      nonfinite = _mm512_add_ps(nonfinite, _mm512_mul_ps(v, zero));
    }
    alignas(64) float a[16], s[16], n[16];
    _mm512_store_ps(a, amax);
    _mm512_store_ps(s, sum);
    _mm512_store_ps(n, nonfinite);
    const LaneTotals tot = fold_lanes(a, s, n);
    const bool finite = tot.finite;
    const __m512 inv = _mm512_set1_ps(group_inverse(tot.amax, finite));
    __m512i qs = _mm512_setzero_si512();
    int8_t* q = xq + k0;
    for (int k = 0; k < group_size; k += 16) {
      const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(xg + k), inv);
      const __m512 r = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
      const __m512i i =
          finite ? _mm512_cvttps_epi32(r) : _mm512_setzero_si512();
      _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi32_epi8(i));
      qs = _mm512_add_epi32(qs, i);
    }
    finish_group(tot.amax, tot.sum, finite, _mm512_reduce_add_epi32(qs), bits, rg[g]);
  }
}

} // namespace mtplx::cpu::qgemm_detail
#endif
