// eval_gpu of GatedDeltaCapture: one launch, threadgroups (row groups, Hv, B)
// of kGdRowsPerGroup simdgroups (metal/gated_delta.h).
#include <string>

#include "gated_delta_rules.h"
#include "metal/device.h"
#include "state_primitives.h"

namespace mtplx {

namespace {

std::string gd_dtype(mx::Dtype t) {
  return t == mx::float32 ? "float32"
                          : (t == mx::float16 ? "float16" : "bfloat16");
}

} // namespace

void GatedDeltaCapture::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
  auto& q = inputs[0]; // [B, T, Hk, Dk], row contiguous (see state_ops.cpp)
  auto& v = inputs[2]; // [B, T, Hv, Dv]
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  const int Hv = v.shape(2), Dv = v.shape(3);

  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  auto* kernel = metal::get_kernel(
      d,
      "gated_delta_capture_" + gd_dtype(q.dtype()) + "_" +
          gd_dtype(inputs[5].dtype()));
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(kernel);
  for (int i = 0; i < 6; ++i) {
    enc.set_input_array(inputs[i], i);
  }
  enc.set_output_array(outputs[0], 6);
  enc.set_output_array(outputs[1], 7);
  enc.set_bytes(T, 8);
  enc.set_bytes(Hk, 9);
  enc.set_bytes(Hv, 10);
  enc.set_bytes(Dk, 11);
  enc.set_bytes(Dv, 12);
  const int groups = (Dv + kGdRowsPerGroup - 1) / kGdRowsPerGroup;
  enc.dispatch_threadgroups(
      MTL::Size(groups, Hv, B), MTL::Size(kGdLanes * kGdRowsPerGroup, 1, 1));
}

} // namespace mtplx
