// MLX primitives of the sampled path: one class per op. eval_cpu lives in
// cpu/sampling.cpp, eval_gpu in metal/sampling.cpp (no_metal_sampling.cpp
// where MLX has no Metal backend). python/mtplx_ext/sampling/reference.py holds the
// definition every kernel follows.
#pragma once

#include <vector>

#include "mlx/primitives.h"

namespace mtplx {

namespace mx = mlx::core;

// Draws one token per row from the transformed distribution of its logits.
// Inputs: logits [B, V] (float32/float16/bfloat16), uniforms [B] float32,
// params [B, kParamCols] float32, then optionally counts [B, V] int32, then
// optionally extra tokens [B, E] (int32/int64; each id in [0, V) counts once
// more, others are ignored). Output: [B] int32, -1 on an unusable row.
class SampleTokens : public mx::UnaryPrimitive {
 public:
  SampleTokens(
      mx::Stream stream,
      bool has_counts,
      bool has_extra,
      bool has_bias = false)
      : mx::UnaryPrimitive(stream),
        has_counts_(has_counts),
        has_extra_(has_extra),
        has_bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "SampleTokens";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  bool has_counts() const {
    return has_counts_;
  }
  bool has_extra() const {
    return has_extra_;
  }
  bool has_bias() const {
    return has_bias_;
  }

 private:
  bool has_counts_;
  bool has_extra_;
  bool has_bias_;
};

// The state of a sampled verification primitive (verify_sampled and its
// chain form): whether counts and a logit bias (ids, values: the last two
// inputs) are inputs.
class SampledVerifyPrimitive : public mx::UnaryPrimitive {
 public:
  SampledVerifyPrimitive(
      mx::Stream stream,
      bool has_counts,
      bool has_bias = false)
      : mx::UnaryPrimitive(stream),
        has_counts_(has_counts),
        has_bias_(has_bias) {}

  // MLX compares only primitives of the same type (typeid) here.
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const SampledVerifyPrimitive&>(other);
    return has_counts_ == o.has_counts_ && has_bias_ == o.has_bias_;
  }

  bool has_counts() const {
    return has_counts_;
  }
  bool has_bias() const {
    return has_bias_;
  }

 protected:
  bool has_counts_;
  bool has_bias_;
};

// Speculative verification of one sampled draft per row, packed into the
// bundle. Inputs: verify_logits [B, 2, V], draft_logits [B, V] (same float
// dtype), tokens [B, 2] (int32/int64), uniforms [B, kUniformCols] float32,
// params [B, kParamCols] float32, then optionally counts [B, V] int32.
// Output: bundle [B, 5] int32 (x0, draft, second, accept, bonus).
class VerifySampled : public SampledVerifyPrimitive {
 public:
  using SampledVerifyPrimitive::SampledVerifyPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "VerifySampled";
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;
};

// Exact speculative verification of K chained sampled drafts per row.
// Inputs: verify_logits [B, K + 1, V], draft_logits [B, K, V] (same float
// dtype), tokens [B, K + 1] (int32/int64: x0, d_1..d_K), uniforms
// [B, K + 2] float32 (u_accept_1..K, u_resample, u_bonus), params
// [B, kParamCols] float32, then optionally counts [B, V] int32, then
// optionally the logit bias ids [B, M] int32 and values [B, M] float32,
// added to every target row and every draft row (the drafts are sampled
// with it, so q is the biased draft distribution).
// Output: the chain bundle [B, K + 3] int32 (layout in mtplx_rules.h).
class VerifySampledChain : public SampledVerifyPrimitive {
 public:
  using SampledVerifyPrimitive::SampledVerifyPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "VerifySampledChain";
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;
};

} // namespace mtplx
