// The packed GEMM's driver (see packed_gemm.h): transposes x in blocks of
// rows, picks the instruction set once, and splits the panels over threads.
#include "cpu/packed_gemm.h"

#include <algorithm>
#include <vector>

#include "cpu/thread_pool.h"

namespace mtplx::cpu {

namespace {

using packed_detail::Call;
using PanelsFn = void (*)(const Call&, int, int);

struct Isa {
  PanelsFn fn;
  const char* name;
};

Isa pick_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) {
    return {packed_detail::panels_avx512, "avx512"};
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return {packed_detail::panels_avx2, "avx2"};
  }
  return {packed_detail::panels_generic, "generic"};
#elif defined(__aarch64__)
  return {packed_detail::panels_generic, "neon"};
#else
  return {packed_detail::panels_generic, "generic"};
#endif
}

const Isa& isa() {
  static const Isa i = pick_isa();
  return i;
}

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
  return isa().name;
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
  const PanelsFn fn = isa().fn;
  for (int64_t b0 = 0; b0 < M; b0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - b0);
    xt.resize(size_t(rows) * K);
    // k outer: the rows' current cache lines stay in L1, writes are in order.
    const float* xb = x + b0 * K;
    float* out = xt.data();
    for (int k = 0; k < K; ++k) {
      for (int64_t i = 0; i < rows; ++i) {
        *out++ = xb[i * K + k];
      }
    }
    const Call c{xt.data(), rows, K, wp, N, y + b0 * N};
    if (parts == 1) {
      fn(c, 0, P);
    } else {
      // Runs of panels claimed in order: first one long run per thread
      // (three quarters of the panels), then two short runs per thread, so
      // that a thread that is behind (preempted, or woken late) leaves only
      // short runs to the others at the end.
      // Fewer panels than that: one run per panel.
      const bool guided = P >= 3 * parts;
      const int tasks = guided ? 3 * parts : P;
      const int64_t head = int64_t(P) * 3 / 4;
      const auto bound = [&](int t) -> int {
        if (!guided) {
          return t;
        }
        if (t <= parts) {
          return int(head * t / parts);
        }
        return int(head + (P - head) * (t - parts) / (tasks - parts));
      };
      parallel_for_pooled(tasks, parts, [&](int t) {
        fn(c, bound(t), bound(t + 1));
      });
    }
  }
}

} // namespace mtplx::cpu
