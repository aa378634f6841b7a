// The packed GEMM's driver (see packed_gemm.h): transposes x in blocks of
// rows, picks the instruction set once, and splits the panels over threads.
#include "cpu/packed_gemm.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/thread_pool.h"

namespace mtplx::cpu {

namespace {

using packed_detail::Call;
using PanelsFn = void (*)(const Call&, int, int);

struct Isa {
  PanelsFn fn;
  const char* name;
  int rows; // rows per full tile (the layout of Call::xt)
};

// Every kernel this build has, fastest first.
#if defined(__x86_64__) && defined(__GNUC__)
const Isa kIsas[] = {
    {packed_detail::panels_avx512, "avx512", packed_detail::kRowsAvx512},
    {packed_detail::panels_avx2, "avx2", packed_detail::kRowsAvx2},
    {packed_detail::panels_generic, "generic", packed_detail::kRowsGeneric}};
#else
const Isa kIsas[] = {
    {packed_detail::panels_generic, "generic", packed_detail::kRowsGeneric}};
#endif

bool cpu_runs(const Isa& i) {
#if defined(__x86_64__) && defined(__GNUC__)
  const std::string name = i.name;
  if (name == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  }
  if (name == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
#endif
  return true;
}

Isa pick_isa() {
  for (const Isa& i : kIsas) {
    if (cpu_runs(i)) {
#if defined(__aarch64__)
      return {i.fn, "neon", i.rows};
#else
      return i;
#endif
    }
  }
  return kIsas[0];  // unreachable: the generic kernel runs everywhere
}

std::atomic<const Isa*> g_isa{nullptr};

const Isa& isa() {
  static const Isa picked = pick_isa();
  const Isa* o = g_isa.load(std::memory_order_acquire);
  return o ? *o : picked;
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

std::string set_packed_gemm_isa(const std::string& name) {
  const Isa* next = nullptr;
  if (!name.empty()) {
    for (const Isa& i : kIsas) {
      if (name == i.name && cpu_runs(i)) {
        next = &i;
      }
    }
    if (next == nullptr) {
      throw std::invalid_argument(
          "isa must be \"avx512\", \"avx2\" or \"generic\" and run on this "
          "CPU, got \"" +
          name + "\"");
    }
  }
  const Isa* previous = g_isa.exchange(next, std::memory_order_acq_rel);
  return previous ? previous->name : "";
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
  const Isa& kernel = isa();
  const PanelsFn fn = kernel.fn;
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
