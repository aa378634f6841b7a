// Access to mtplx_ext's own Metal kernels (macOS builds only).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "metal/launch_plan.h"
#include "mlx/backend/metal/device.h"

namespace mtplx::metal {

namespace mx = mlx::core;

// Directory of the loaded extension module, where mtplx_ext.metallib is
// installed next to it.
const std::string& module_dir();

// Pipeline state of the kernel with this host name, from mtplx_ext.metallib
// or, in builds that embed the kernel source, from that source.
MTL::ComputePipelineState* get_kernel(
    mx::metal::Device& d,
    const std::string& name);

// Kernel-name spelling of a logits dtype: float32, float16 or bfloat16.
inline const char* logit_dtype_name(mx::Dtype t) {
  if (t == mx::float32) {
    return "float32";
  }
  return t == mx::float16 ? "float16" : "bfloat16";
}

// Launches kernel `name` with one threadgroup per row, of
// threads(vocab, the pipeline's limit) threads; bind(enc) sets its buffers.
template <class Bind>
void launch_rows(
    const mx::Stream& s,
    const std::string& name,
    int rows,
    int vocab,
    int (*threads)(int, int),
    Bind&& bind) {
  auto& d = mx::metal::device(s.device);
  auto* kernel = get_kernel(d, name);
  const int n = threads(vocab, int(kernel->maxTotalThreadsPerThreadgroup()));
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(kernel);
  std::forward<Bind>(bind)(enc);
  enc.dispatch_threadgroups(MTL::Size(rows, 1, 1), MTL::Size(n, 1, 1));
}

// Launches verification kernel `op` (one threadgroup per stream) for the
// dtypes of logits [B, T, V] or [B, 2, V] and tokens, after allocating out;
// bind(enc) sets its buffers.
template <class Bind>
void launch_verify_rows(
    const mx::Stream& s,
    const std::string& op,
    const mx::array& logits,
    const mx::array& tokens,
    mx::array& out,
    int (*threads)(int, int),
    Bind&& bind) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  launch_rows(
      s,
      row_kernel(op, logit_dtype_name(logits.dtype()), tokens.dtype() == mx::int64),
      logits.shape(0),
      logits.shape(2),
      threads,
      std::forward<Bind>(bind));
}

// Buffers of the sampled verification kernels (verify_sampled and
// verify_sampled_chain, metal/sampling.h and metal/chain.h): the five inputs,
// counts (the verify logits as a filler the kernel never reads when
// has_counts is off), the bundle, V and has_counts (the chain kernel takes
// its drafts at 9).
inline void bind_sampled_verify(
    mx::metal::CommandEncoder& enc,
    const std::vector<mx::array>& inputs,
    bool has_counts,
    mx::array& out,
    int vocab) {
  const int counts_flag = has_counts ? 1 : 0;
  for (int i = 0; i < 5; ++i) {
    enc.set_input_array(inputs[i], i);
  }
  enc.set_input_array(has_counts ? inputs[5] : inputs[0], 5);
  enc.set_output_array(out, 6);
  enc.set_bytes(vocab, 7);
  enc.set_bytes(counts_flag, 8);
}

} // namespace mtplx::metal
