// eval_gpu of SnapshotState / RestoreState: all leaves in launches of up to
// kMaxCopyLeaves leaves each (metal/state_copy.h), never one per leaf.
#include <algorithm>
#include <cstdint>

#include "metal/device.h"
#include "metal/launch_plan.h"
#include "state_primitives.h"

namespace mtplx {

namespace {

constexpr int kCopyThreads = 256;

uintptr_t address_of(const mx::array& a) {
  return reinterpret_cast<uintptr_t>(a.data<char>());
}

// Copies inputs[snap + i] (or, per masked row, inputs[live + i]) into
// outputs[i]. live < 0 and mask < 0 when there is no row mask.
void copy_leaves(
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    int snap,
    int live,
    int mask,
    std::vector<mx::array>& outputs) {
  const bool masked = mask >= 0;
  std::vector<metal::CopyLeafInfo> infos;
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto& out = outputs[i];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& src = inputs[snap + i];
    uintptr_t bits = 0;
    if (out.nbytes() > 0) {
      bits = address_of(src) | address_of(out);
      if (masked) {
        bits |= address_of(inputs[live + i]);
      }
    }
    uint64_t rows = src.ndim() > 0 ? uint64_t(src.shape(0)) : 1;
    infos.push_back({uint64_t(out.nbytes()), rows, bits});
  }

  auto& d = mx::metal::device(s.device);
  auto* kernel =
      metal::get_kernel(d, masked ? "state_copy_masked" : "state_copy");
  const int threads =
      std::min<int>(kCopyThreads, int(kernel->maxTotalThreadsPerThreadgroup()));
  auto& enc = mx::metal::get_command_encoder(s);
  for (auto& launch : metal::plan_state_copy(infos, masked, threads)) {
    enc.set_compute_pipeline_state(kernel);
    const int n = int(launch.leaves.size());
    // Every buffer argument gets a binding; unused slots repeat a source
    // leaf, which the kernel never reads there.
    const auto& filler = inputs[snap + launch.leaves[0]];
    for (int slot = 0; slot < kMaxCopyLeaves; ++slot) {
      if (slot < n) {
        const int i = launch.leaves[slot];
        enc.set_input_array(inputs[snap + i], slot);
        enc.set_input_array(masked ? inputs[live + i] : filler, 8 + slot);
        enc.set_output_array(outputs[i], 16 + slot);
      } else {
        enc.set_input_array(filler, slot);
        enc.set_input_array(filler, 8 + slot);
        enc.set_input_array(filler, 16 + slot);
      }
    }
    enc.set_bytes(launch.table.data(), kMaxCopyLeaves, 24);
    enc.set_input_array(masked ? inputs[mask] : filler, 25);
    enc.dispatch_threadgroups(
        MTL::Size(launch.groups_x, n, 1), MTL::Size(threads, 1, 1));
  }
}

} // namespace

void SnapshotState::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  copy_leaves(stream(), inputs, 0, -1, -1, outputs);
}

void RestoreState::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const int n = num_leaves_;
  if (masked_) {
    copy_leaves(stream(), inputs, n, 0, 2 * n, outputs);
  } else {
    copy_leaves(stream(), inputs, n, -1, -1, outputs);
  }
}

} // namespace mtplx
