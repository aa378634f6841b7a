// The AVX-512 VNNI traits of the quantized GEMM's loops (qgemm_kernel.h):
// one vpdpbusd adds 4 products to each of 16 columns. Included by the files
// compiled with -mavx512f -mavx512bw -mavx512vnni (qgemm_avx512.cpp, and
// qgemm_amx.cpp, whose fold and one-row tiles are these).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu/qgemm_kernel.h"

namespace mtplx::cpu::qgemm_detail {

struct Avx512Vnni {
  using Acc = __m512i;
  using W = __m512i;
  using F = __m512;
  static Acc zero() { return _mm512_setzero_si512(); }
  static W load_w(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static W lo(W w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  static W hi(W w) {
    return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F));
  }
  template <bool Small>
  static Acc dot(Acc acc, W w, int32_t x4) {
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
  }
  template <ScaleType S>
  static F scales(const typename ScaleBits<S>::type* p) {
    if constexpr (S == ScaleType::f32) {
      return _mm512_loadu_ps(p);
    } else if constexpr (S == ScaleType::f16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    } else {
      const __m512i u =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
  }
  static void fold(float* y, Acc a, F s, F b, const RowGroup& rg) {
    const __m512i i = _mm512_sub_epi32(a, _mm512_set1_epi32(rg.cq));
    const F t = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(i), _mm512_set1_ps(rg.d), _mm512_set1_ps(rg.cxs));
    F v = _mm512_fmadd_ps(s, t, _mm512_loadu_ps(y));
    v = _mm512_fmadd_ps(b, _mm512_set1_ps(rg.xs), v);
    _mm512_storeu_ps(y, v);
  }
};


} // namespace mtplx::cpu::qgemm_detail
#endif
