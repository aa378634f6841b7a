// MLX primitives of greedy verification: one class per op. eval_cpu lives in
// cpu/verify_greedy.cpp, eval_gpu in metal/verify_greedy.cpp (or
// no_metal.cpp where MLX has no Metal backend).
#pragma once

#include <vector>

#include "mlx/primitives.h"

namespace mtplx {

namespace mx = mlx::core;

// Greedy verification of one MTP draft per stream, packed into the bundle.
// Inputs: logits [B, 2, V] (float32/float16/bfloat16, row contiguous),
// tokens [B, 2] (int32 or int64). Output: bundle [B, 5] int32.
class VerifyGreedy : public mx::UnaryPrimitive {
 public:
  explicit VerifyGreedy(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "VerifyGreedy";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;
};

// Greedy verification of K chained drafts per stream (K = T - 1 in 1..8).
// Inputs: logits [B, T, V] (float32/float16/bfloat16, row contiguous),
// tokens [B, T] (int32 or int64: x0, d_1..d_K), then optionally the logit
// bias ids [B, M] int32 and values [B, M] float32 (each row's argmax is
// that of its biased logits). Output: the chain bundle [B, K + 3] int32
// (layout in mtplx_rules.h).
class VerifyGreedyChain : public mx::UnaryPrimitive {
 public:
  explicit VerifyGreedyChain(mx::Stream stream, bool has_bias = false)
      : mx::UnaryPrimitive(stream), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "VerifyGreedyChain";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return has_bias_ ==
        static_cast<const VerifyGreedyChain&>(other).has_bias_;
  }
  bool has_bias() const {
    return has_bias_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  bool has_bias_;
};

} // namespace mtplx
