// The packed GEMM's driver (see packed_gemm.h): transposes x in blocks of
// rows, picks the instruction set once, and splits the panels over threads.
#include "cpu/packed_gemm.h"

#include <algorithm>
#include <string>
#include <vector>

#include "cpu/kernel_choice.h"

namespace mtplx::cpu {

namespace {

using packed_detail::Call;

// One variant's kernel and its rows per full tile (the layout of Call::xt).
struct Kernel {
  void (*fn)(const Call&, int, int);
  int rows;
};

const Kernel kGeneric{packed_detail::panels_generic, packed_detail::kRowsGeneric};
#if defined(__x86_64__) && defined(__GNUC__)
const Kernel kAvx512{packed_detail::panels_avx512, packed_detail::kRowsAvx512};
const Kernel kAvx2{packed_detail::panels_avx2, packed_detail::kRowsAvx2};
bool runs_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
}
bool runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
// Every kernel this build has, fastest first.
const KernelVariant<const Kernel*> kVariants[] = {
    {&kAvx512, "avx512", runs_avx512},
    {&kAvx2, "avx2", runs_avx2},
    {&kGeneric, "generic", runs_everywhere}};
#else
const KernelVariant<const Kernel*> kVariants[] = {
    {&kGeneric, "generic", runs_everywhere}};
#endif

KernelChoice g_kernel(kVariants);

// Rows per block of x: the transposed block (K x 64 floats) stays in L2
// beside the panel being computed, and every panel is streamed from memory
// once per block.
constexpr int64_t kRowBlock = 64;

// Weights of at least this many bytes split their panels over threads: a
// worker's wake-up (a few microseconds) is then well under the product's
// time, which the second core's read rate and FMAs shorten.
constexpr int64_t kSplitBytes = 1 << 20;

} // namespace

const char* packed_gemm_isa() {
#if defined(__aarch64__)
  return "neon";  // the generic kernel, compiled for NEON
#else
  return g_kernel.get().name;
#endif
}

std::string set_packed_gemm_isa(const std::string& name) {
  return g_kernel.set(name);
}

void packed_gemm(
    const float* x,
    int64_t M,
    int K,
    const float* wp,
    int N,
    float* y,
    int threads) {
  const int P = (N + kPackedPanel - 1) / kPackedPanel;
  const int64_t w_bytes = int64_t(P) * K * kPackedPanel * 4;
  const int parts =
      (threads > 1 && w_bytes >= kSplitBytes) ? std::min(threads, P) : 1;
  thread_local std::vector<float> xt;
  const Kernel& kernel = *g_kernel.get().fn;
  const auto fn = kernel.fn;
  for (int64_t b0 = 0; b0 < M; b0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - b0);
    xt.resize(size_t(rows) * K);
    // Tile by tile (packed_detail::Call), k outer: the tile's rows' current
    // cache lines stay in L1, writes are in order.
    const packed_detail::RowTiles tiles(rows, kernel.rows);
    float* out = xt.data();
    for (int64_t t = 0; t < tiles.count; ++t) {
      const float* xb = x + (b0 + tiles.start(t)) * K;
      const int64_t r = tiles.size(t);
      for (int k = 0; k < K; ++k) {
        for (int64_t i = 0; i < r; ++i) {
          *out++ = xb[i * K + k];
        }
      }
    }
    const Call c{xt.data(), rows, K, wp, N, y + b0 * N};
    parallel_panels(P, parts, [&](int p0, int p1) { fn(c, p0, p1); });
  }
}

} // namespace mtplx::cpu
