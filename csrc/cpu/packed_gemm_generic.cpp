// The packed GEMM for any other CPU (arm64's NEON, x86-64 without AVX2):
// 4-lane vectors of the compiler's vector extensions, tiles of up to 4 rows
// x 6 vectors. fma is an explicit fused multiply-add per lane, so the result
// is the same FMA chain as the x86 kernels'.
#include <cmath>

#include "cpu/packed_gemm_kernel.h"

namespace mtplx::cpu::packed_detail {
namespace {

typedef float v4 __attribute__((vector_size(16)));

struct Generic {
  using V = v4;
  static constexpr int kLanes = 4;
  static constexpr int kRows = kRowsGeneric;
  static constexpr int kCols = 6;
  static V zero() { return V{0, 0, 0, 0}; }
  static V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }
  static V set1(float x) { return V{x, x, x, x}; }
  static V fma(V a, V b, V c) {
    return V{
        std::fma(a[0], b[0], c[0]),
        std::fma(a[1], b[1], c[1]),
        std::fma(a[2], b[2], c[2]),
        std::fma(a[3], b[3], c[3])};
  }
};

} // namespace

void panels_generic(const Call& c, int p0, int p1) {
  panels<Generic>(c, p0, p1);
}

} // namespace mtplx::cpu::packed_detail
