// The quantized packed GEMM for AVX2 + FMA + F16C (compiled with -mavx2
// -mfma -mf16c): a block of 16 columns is two 8-lane halves. Without VNNI
// the 4-product sums come from vpmaddubsw (pairs, saturating at 2^15: exact
// for q < 16) and vpmaddwd; a byte q is split into its nibbles first.
#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu/qgemm_kernel.h"

namespace mtplx::cpu::qgemm_detail {
namespace {

struct Pair {
  __m256i a, b;
};
struct PairF {
  __m256 a, b;
};

struct Avx2 {
  using Acc = Pair;
  using W = Pair;
  using F = PairF;
  static Acc zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static W load_w(const uint8_t* p) {
    return {
        _mm256_loadu_si256((const __m256i*)p),
        _mm256_loadu_si256((const __m256i*)(p + 32))};
  }
  static __m256i lo1(__m256i w) {
    return _mm256_and_si256(w, _mm256_set1_epi8(0x0F));
  }
  static __m256i hi1(__m256i w) {
    return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F));
  }
  static W lo(W w) { return {lo1(w.a), lo1(w.b)}; }
  static W hi(W w) { return {hi1(w.a), hi1(w.b)}; }
  template <bool Small>
  static __m256i dot1(__m256i acc, __m256i w, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (Small) {
      return _mm256_add_epi32(
          acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
    } else {
      const __m256i l = _mm256_maddubs_epi16(lo1(w), x);
      const __m256i h = _mm256_maddubs_epi16(hi1(w), x);
      const __m256i s = _mm256_add_epi32(
          _mm256_madd_epi16(l, ones),
          _mm256_madd_epi16(h, _mm256_set1_epi16(16)));
      return _mm256_add_epi32(acc, s);
    }
  }
  template <bool Small>
  static Acc dot(Acc acc, W w, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    return {dot1<Small>(acc.a, w.a, x), dot1<Small>(acc.b, w.b, x)};
  }
  template <ScaleType S>
  static __m256 scales8(const typename ScaleBits<S>::type* p) {
    if constexpr (S == ScaleType::f32) {
      return _mm256_loadu_ps(p);
    } else if constexpr (S == ScaleType::f16) {
      return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    } else {
      const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
      return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
  }
  template <ScaleType S>
  static F scales(const typename ScaleBits<S>::type* p) {
    return {scales8<S>(p), scales8<S>(p + 8)};
  }
  static void fold1(float* y, __m256i a, __m256 s, __m256 b, const RowGroup& rg) {
    const __m256i i = _mm256_sub_epi32(a, _mm256_set1_epi32(rg.cq));
    const __m256 t = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(i), _mm256_set1_ps(rg.d), _mm256_set1_ps(rg.cxs));
    __m256 v = _mm256_fmadd_ps(s, t, _mm256_loadu_ps(y));
    v = _mm256_fmadd_ps(b, _mm256_set1_ps(rg.xs), v);
    _mm256_storeu_ps(y, v);
  }
  static void fold(float* y, Acc a, F s, F b, const RowGroup& rg) {
    fold1(y, a.a, s.a, b.a, rg);
    fold1(y + 8, a.b, s.b, b.b, rg);
  }
};

} // namespace

MTPLX_QGEMM_INSTANTIATE(panels_avx2, Avx2)

// quantize_row_generic's operations, 16 lanes as two ymm (qgemm.cpp).
void quantize_row_avx2(
    const float* x,
    int K,
    int group_size,
    int bits,
    int8_t* xq,
    RowGroup* rg) {
  static_assert(kQuantLanes == 16);
  const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  const __m256 magic = _mm256_set1_ps(kRoundMagic);
  for (int g = 0, k0 = 0; k0 < K; ++g, k0 += group_size) {
    const float* xg = x + k0;
    __m256 amax[2] = {zero, zero}, sum[2] = {zero, zero},
           nonfinite[2] = {zero, zero};
    for (int k = 0; k < group_size; k += 16) {
      for (int h = 0; h < 2; ++h) {
        const __m256 v = _mm256_loadu_ps(xg + k + 8 * h);
        amax[h] = _mm256_max_ps(_mm256_andnot_ps(sign, v), amax[h]);
        sum[h] = _mm256_add_ps(sum[h], v);
        nonfinite[h] =
            _mm256_add_ps(nonfinite[h], _mm256_mul_ps(v, zero));
      }
    }
    alignas(32) float a[16], s[16], n[16];
    for (int h = 0; h < 2; ++h) {
      _mm256_store_ps(a + 8 * h, amax[h]);
      _mm256_store_ps(s + 8 * h, sum[h]);
      _mm256_store_ps(n + 8 * h, nonfinite[h]);
    }
    const LaneTotals tot = fold_lanes(a, s, n);
    const bool finite = tot.finite;
    const __m256 inv = _mm256_set1_ps(group_inverse(tot.amax, finite));
    __m256i qs = _mm256_setzero_si256();
    int8_t* q = xq + k0;
    for (int k = 0; k < group_size; k += 16) {
      __m256i i[2];
      for (int h = 0; h < 2; ++h) {
        const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xg + k + 8 * h), inv);
        const __m256 r = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
        i[h] = finite ? _mm256_cvttps_epi32(r) : _mm256_setzero_si256();
        qs = _mm256_add_epi32(qs, i[h]);
      }
      // int32 -> int8 (|value| <= 127: the saturating packs are exact).
      __m256i w16 = _mm256_packs_epi32(i[0], i[1]);
      w16 = _mm256_permute4x64_epi64(w16, 0xD8);
      const __m256i w8 = _mm256_packs_epi16(w16, w16);
      _mm_storeu_si128(
          (__m128i*)(q + k),
          _mm256_castsi256_si128(_mm256_permute4x64_epi64(w8, 0x08)));
    }
    alignas(32) int32_t qv[8];
    _mm256_store_si256((__m256i*)qv, qs);
    int32_t qsum = 0;
    for (int l = 0; l < 8; ++l) {
      qsum += qv[l];
    }
    finish_group(tot.amax, tot.sum, finite, qsum, bits, rg[g]);
  }
}

} // namespace mtplx::cpu::qgemm_detail
#endif
