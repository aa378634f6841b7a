// The host side of each primitive's eval_gpu, for the emulator: the same
// launch plans (csrc/metal/launch_plan.h) and buffer slots as the Metal glue,
// with memu_launch standing in for the command encoder.
#include <cstdint>
#include <string>
#include <vector>

#include "metal/launch_plan.h"

extern "C" int memu_launch(
    const char* name,
    const uint32_t* grid,
    const uint32_t* tg,
    int n_buffers,
    void* const* ptrs,
    const uint64_t* sizes,
    int n_tg_params,
    const uint64_t* tg_param_lengths,
    double timeout_s,
    char* err,
    int err_len);

namespace {
constexpr double kTimeout = 120.0;
}

extern "C" {

// verify_greedy as eval_gpu launches it. threads = 0 uses the plan's size;
// prefix selects a test fixture's copy of the kernel ("" for the real one).
int memu_verify_greedy(
    const char* prefix,
    void* logits,
    uint64_t logits_bytes,
    const char* dtype,
    void* tokens,
    uint64_t tokens_bytes,
    int tok64,
    void* bundle,
    uint64_t bundle_bytes,
    int batch,
    int vocab,
    int threads,
    char* err,
    int err_len) {
  std::string name =
      prefix + mtplx::metal::row_kernel("verify_greedy", dtype, tok64 != 0);
  int tg = threads > 0 ? threads
                       : mtplx::metal::verify_greedy_threads(vocab, 1024);
  uint32_t grid[3] = {uint32_t(batch), 1, 1};
  uint32_t tgs[3] = {uint32_t(tg), 1, 1};
  void* ptrs[4] = {logits, tokens, bundle, &vocab};
  uint64_t sizes[4] = {logits_bytes, tokens_bytes, bundle_bytes, sizeof(int)};
  return memu_launch(
      name.c_str(), grid, tgs, 4, ptrs, sizes, 0, nullptr, kTimeout, err,
      err_len);
}

// snapshot_state (masked = 0, live unused) and restore_state as eval_gpu
// launches them: leaves in groups of kMaxCopyLeaves, one launch per group.
int memu_state_copy(
    const char* prefix,
    int n_leaves,
    void* const* snap,
    void* const* live,
    void* const* out,
    const uint64_t* nbytes,
    const uint64_t* rows,
    void* row_mask,
    uint64_t mask_bytes,
    int masked,
    int threads,
    char* err,
    int err_len) {
  using namespace mtplx;
  std::vector<metal::CopyLeafInfo> infos;
  for (int i = 0; i < n_leaves; ++i) {
    uintptr_t bits = reinterpret_cast<uintptr_t>(snap[i]) |
        reinterpret_cast<uintptr_t>(out[i]);
    if (masked) {
      bits |= reinterpret_cast<uintptr_t>(live[i]);
    }
    infos.push_back({nbytes[i], rows[i], bits});
  }
  int tg = threads > 0 ? threads : 256;
  for (auto& launch : metal::plan_state_copy(infos, masked != 0, tg)) {
    void* ptrs[26] = {};
    uint64_t sizes[26] = {};
    for (size_t s = 0; s < launch.leaves.size(); ++s) {
      int i = launch.leaves[s];
      ptrs[s] = snap[i];
      sizes[s] = nbytes[i];
      if (masked) {
        ptrs[8 + s] = live[i];
        sizes[8 + s] = nbytes[i];
      }
      ptrs[16 + s] = out[i];
      sizes[16 + s] = nbytes[i];
    }
    ptrs[24] = launch.table.data();
    sizes[24] = sizeof(LeafCopy) * launch.leaves.size();
    if (masked) {
      ptrs[25] = row_mask;
      sizes[25] = mask_bytes;
    }
    uint32_t grid[3] = {
        uint32_t(launch.groups_x), uint32_t(launch.leaves.size()), 1};
    uint32_t tgs[3] = {uint32_t(tg), 1, 1};
    std::string name =
        std::string(prefix) + (masked ? "state_copy_masked" : "state_copy");
    int rc = memu_launch(
        name.c_str(), grid, tgs, 26, ptrs, sizes, 0, nullptr, kTimeout, err, err_len);
    if (rc != 0) {
      return rc;
    }
  }
  return 0;
}

} // extern "C"
