// eval_gpu for builds without our Metal kernels (Linux, CUDA builds of MLX).
#include <stdexcept>
#include <string>

#include "state_primitives.h"
#include "verify_primitives.h"
#include "sampling_primitives.h"

namespace mtplx {

namespace {

[[noreturn]] void no_gpu_kernel(const char* op) {
  throw std::runtime_error(
      std::string("mtplx_ext.") + op +
      ": this build has no kernel for MLX's GPU backend on this platform "
      "(Metal kernels are built on macOS only); pass stream=mx.cpu.");
}

} // namespace

void VerifyGreedy::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernel("verify_greedy");
}

void SnapshotState::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  no_gpu_kernel("snapshot_state");
}

void RestoreState::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  no_gpu_kernel("restore_state");
}

void SampleTokens::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernel("sample_tokens");
}

void VerifySampled::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernel("verify_sampled");
}

void VerifyGreedyChain::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernel("verify_greedy_chain");
}

void VerifySampledChain::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernel("verify_sampled_chain");
}

void GatedDeltaCapture::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  no_gpu_kernel("gated_delta_capture");
}

} // namespace mtplx
