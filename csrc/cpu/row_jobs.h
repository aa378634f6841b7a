// Shared pieces of the CPU row kernels (sampled and chain primitives): id
// reads, per-thread builders, uniforms and the thread count of a row job.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "cpu/sampling.h"
#include "cpu/thread_pool.h"
#include "mlx/array.h"
#include "mtplx_rules.h"

namespace mtplx::cpu {

namespace mx = mlx::core;

// Largest double below 1: uniforms are used in [0, 1).
inline constexpr double kUniformOneBelow = 0x1.fffffffffffffp-1;

inline size_t row_bytes(const mx::array& a, int V) {
  return size_t(V) * a.itemsize();
}

inline int64_t read_id(const mx::array& a, size_t i) {
  return a.dtype() == mx::int32 ? int64_t(a.data<int32_t>()[i])
                                : a.data<int64_t>()[i];
}

// Builders are kept per thread between evaluations: their V-sized buffers
// would otherwise be faulted in afresh on every call.
inline RowDistBuilder& cached_builder(int slot, int V) {
  thread_local std::unique_ptr<RowDistBuilder> cache[3];
  if (!cache[slot] || cache[slot]->vocab() != V) {
    cache[slot] = std::make_unique<RowDistBuilder>(V);
  }
  return *cache[slot];
}

inline double uniform_at(const float* u, size_t i) {
  return clamp_uniform<double>(double(u[i]), kUniformOneBelow);
}

// Rough single-thread cost of building one distribution of a row of V
// logits, in nanoseconds (measured on the development machine; only the
// order of magnitude matters): a sparse top-k row is one vectorised scan,
// about 2 us + 0.25 ns per logit; a dense row (top-k off or large) about
// 12 ns per logit (transform, exp, selects).
inline double build_cost_ns(const float* params, int V) {
  const auto s = RowSampler::from_params(params);
  const int kk = s.temperature > 0 ? top_k_length(s.top_k, V) : 1;
  const bool sparse =
      kk < V && kk <= RowDistBuilder::kSparseLimit && kk < V / 4;
  return sparse ? 2000.0 + 0.25 * V : 12.0 * V;
}

// Threads for a job of `rows` independent rows costing `cost_ns` in all:
// each thread beyond the first must get at least kMinThreadNs of work, so
// jobs too small to pay for waking a worker never leave the caller's thread.
inline int row_threads(int rows, double cost_ns) {
  constexpr double kMinThreadNs = 30000.0;
  const int configured = cpu_threads_or_one();
  if (rows < 2 || configured < 2 || cost_ns < 2 * kMinThreadNs) {
    return 1;
  }
  const double by_cost = cost_ns / kMinThreadNs;
  return int(std::min<double>({double(configured), double(rows), by_cost}));
}

} // namespace mtplx::cpu
