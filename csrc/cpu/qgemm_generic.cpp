// The quantized packed GEMM for any other CPU: 16-lane vectors of the
// compiler's vector extensions, integer sums lane by lane, and std::fma per
// lane in the fold, so every output is the x86 kernels' bits.
#include <cmath>

#include "cpu/half_bits.h"
#include "cpu/qgemm_kernel.h"

namespace mtplx::cpu::qgemm_detail {
namespace {

typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint8_t vu64 __attribute__((vector_size(64)));
typedef float vf16 __attribute__((vector_size(64)));

struct Generic {
  using Acc = vi16;
  using W = vu64;
  using F = vf16;
  static Acc zero() { return Acc{}; }
  static W load_w(const uint8_t* p) {
    W w;
    std::memcpy(&w, p, sizeof(w));
    return w;
  }
  static W lo(W w) { return w & uint8_t(0x0F); }
  static W hi(W w) { return w >> uint8_t(4); }
  template <bool Small>
  static Acc dot(Acc acc, W w, int32_t x4) {
    int8_t x[4];
    std::memcpy(x, &x4, 4);
    for (int l = 0; l < 16; ++l) {
      acc[l] += int32_t(w[4 * l]) * x[0] + int32_t(w[4 * l + 1]) * x[1] +
          int32_t(w[4 * l + 2]) * x[2] + int32_t(w[4 * l + 3]) * x[3];
    }
    return acc;
  }
  template <ScaleType S>
  static F scales(const typename ScaleBits<S>::type* p) {
    F f;
    for (int l = 0; l < 16; ++l) {
      if constexpr (S == ScaleType::f32) {
        f[l] = p[l];
      } else if constexpr (S == ScaleType::f16) {
        f[l] = half_bits_to_float(p[l]);
      } else {
        f[l] = bf16_bits_to_float(p[l]);
      }
    }
    return f;
  }
  static void fold(float* y, Acc a, F s, F b, const RowGroup& rg) {
    for (int l = 0; l < 16; ++l) {
      const float t = std::fma(float(a[l] - rg.cq), rg.d, rg.cxs);
      y[l] = std::fma(b[l], rg.xs, std::fma(s[l], t, y[l]));
    }
  }
};

} // namespace

MTPLX_QGEMM_INSTANTIATE(panels_generic, Generic)

} // namespace mtplx::cpu::qgemm_detail
