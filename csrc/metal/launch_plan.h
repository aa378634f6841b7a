// Launch plans of the Metal kernels: kernel names, threadgroup sizes and the
// state copy table. Plain C++ (no Metal or MLX headers), so the eval_gpu
// glue and the test suite's threadgroup emulator share exactly this code.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "state_copy_table.h"

namespace mtplx::metal {

// Host name of a row kernel's instantiation, e.g.
// "verify_sampled_chain_float16_int64" (op, logits dtype: "float32",
// "float16" or "bfloat16", token dtype).
inline std::string row_kernel(
    const std::string& op,
    const std::string& dtype,
    bool tok64) {
  return op + "_" + dtype + (tok64 ? "_int64" : "_int32");
}

// ---- verify_greedy ---------------------------------------------------------

// Threads per row: about 8 logits per thread and position, a multiple of the
// 32-lane simdgroup, at most max_threads (the pipeline's limit, <= 1024).
inline int verify_greedy_threads(int vocab, int max_threads) {
  int cap = max_threads < 1024 ? max_threads : 1024;
  cap = cap / 32 * 32;
  if (cap < 32) {
    cap = 32;
  }
  int want = (vocab + 7) / 8;
  want = (want + 31) / 32 * 32;
  return want < 32 ? 32 : (want > cap ? cap : want);
}

// ---- sampling and chain kernels ------------------------------------------

// Threads per stream of the sampling kernels: they make many passes over
// the row, so the widest threadgroup the pipeline allows (a multiple of 32,
// <= 1024), no wider than the vocabulary needs.
inline int sampling_threads(int vocab, int max_threads) {
  int cap = (max_threads < 1024 ? max_threads : 1024) / 32 * 32;
  int want = (vocab + 31) / 32 * 32;
  want = want < cap ? want : cap;
  return want < 32 ? 32 : want;
}

// ---- snapshot / restore ------------------------------------------------------

// What the plan needs to know of one leaf.
struct CopyLeafInfo {
  uint64_t nbytes; // bytes of the leaf (0: nothing to copy)
  uint64_t rows; // leading dimension B (row mask granularity); >= 1
  uintptr_t address_bits; // OR of the addresses of all its buffers
};

// One kernel launch: up to kMaxCopyLeaves leaves, as table rows.
struct CopyLaunch {
  std::vector<int> leaves; // indices into the input list
  std::array<LeafCopy, kMaxCopyLeaves> table{};
  uint64_t groups_x = 0; // threadgroups along x (chunks of the longest leaf)
};

// Widest copy unit (log2 bytes, at most 16 bytes) that divides the bytes to
// copy per row and the alignment of every address involved.
inline uint32_t copy_unit_log2(uint64_t row_bytes, uintptr_t address_bits) {
  uint32_t u = 4;
  while (u > 0 &&
         ((row_bytes & ((uint64_t(1) << u) - 1)) != 0 ||
          (address_bits & ((uintptr_t(1) << u) - 1)) != 0)) {
    --u;
  }
  return u;
}

// Splits the non-empty leaves into launches of at most kMaxCopyLeaves. With
// `masked`, copy units never straddle a row (the kernel picks the source of
// each unit from the row mask).
inline std::vector<CopyLaunch> plan_state_copy(
    const std::vector<CopyLeafInfo>& leaves,
    bool masked,
    int threads_per_group) {
  std::vector<CopyLaunch> launches;
  const uint64_t per_group =
      uint64_t(threads_per_group) * uint64_t(kCopyUnitsPerThread);
  for (int i = 0; i < int(leaves.size()); ++i) {
    const auto& leaf = leaves[i];
    if (leaf.nbytes == 0) {
      continue;
    }
    if (launches.empty() ||
        launches.back().leaves.size() == size_t(kMaxCopyLeaves)) {
      launches.emplace_back();
    }
    auto& launch = launches.back();
    const uint64_t rows = leaf.rows == 0 ? 1 : leaf.rows;
    const uint64_t row_bytes = masked ? leaf.nbytes / rows : leaf.nbytes;
    const uint32_t u = copy_unit_log2(row_bytes, leaf.address_bits);
    LeafCopy row{};
    row.n_units = leaf.nbytes >> u;
    row.row_units = masked ? uint32_t(row_bytes >> u) : 0u;
    row.unit_log2 = u;
    launch.table[launch.leaves.size()] = row;
    launch.leaves.push_back(i);
    const uint64_t groups = (row.n_units + per_group - 1) / per_group;
    if (groups > launch.groups_x) {
      launch.groups_x = groups;
    }
  }
  return launches;
}

} // namespace mtplx::metal
