#include <cstring>

#include "cpu/fused_common.h"
#include "mlx/backend/cpu/encoder.h"
#include "state_primitives.h"

namespace mtplx {

void SnapshotState::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto job = [](std::vector<mx::array>& in, std::vector<mx::array>& out) {
    for (size_t i = 0; i < in.size(); ++i) {
      if (in[i].nbytes() > 0) {
        std::memcpy(out[i].data<void>(), in[i].data<void>(), in[i].nbytes());
      }
    }
  };
  cpu::dispatch_cpu_outputs(stream(), inputs, outputs, std::move(job));
}

void RestoreState::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto job = [n = num_leaves_, masked = masked_](
                 std::vector<mx::array>& in, std::vector<mx::array>& out) {
    const bool* mask = masked ? in[2 * n].data<bool>() : nullptr;
    for (int i = 0; i < n; ++i) {
      auto& live = in[i];
      auto& snap = in[n + i];
      auto* dst = static_cast<char*>(out[i].data<void>());
      if (live.nbytes() == 0) {
        continue;
      }
      if (!mask) {
        std::memcpy(dst, snap.data<void>(), snap.nbytes());
        continue;
      }
      const int B = live.shape(0);
      const size_t row_bytes = live.nbytes() / size_t(B);
      auto* src_live = static_cast<const char*>(live.data<void>());
      auto* src_snap = static_cast<const char*>(snap.data<void>());
      for (int b = 0; b < B; ++b) {
        const char* src = mask[b] ? src_snap : src_live;
        std::memcpy(dst + b * row_bytes, src + b * row_bytes, row_bytes);
      }
    }
  };
  cpu::dispatch_cpu_outputs(stream(), inputs, outputs, std::move(job));
}

} // namespace mtplx
