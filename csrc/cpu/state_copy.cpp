#include <cstring>

#include "cpu/fused_common.h"
#include "mlx/backend/cpu/encoder.h"
#include "primitives.h"

namespace mtplx {

using cpu::weak_copies;

void SnapshotState::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (size_t i = 0; i < inputs.size(); ++i) {
    outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
    enc.set_input_array(inputs[i]);
    enc.set_output_array(outputs[i]);
  }
  enc.dispatch([in = weak_copies(inputs), out = weak_copies(outputs)]() mutable {
    for (size_t i = 0; i < in.size(); ++i) {
      if (in[i].nbytes() > 0) {
        std::memcpy(out[i].data<void>(), in[i].data<void>(), in[i].nbytes());
      }
    }
  });
}

void RestoreState::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
  }
  enc.dispatch([in = weak_copies(inputs),
                out = weak_copies(outputs),
                n = num_leaves_,
                masked = masked_]() mutable {
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
  });
}

} // namespace mtplx
