// Single-node CPU primitives for mx.fast.rms_norm, mx.fast.rope,
// mx.fast.scaled_dot_product_attention and mlx-lm's swiglu. On MLX's CPU
// backend the first three expand into their composed fallback graphs (about
// 8, 20 and 15 nodes each) and swiglu compiles into a scalar loop; these run
// the same math in one vectorised node. eval_cpu lives in cpu/; there is no Metal
// code: the ops (fused_ops.cpp) send GPU streams straight to mx::fast, whose
// Metal kernels are already fused, so eval_gpu is never reached.
//
// vjp and jvp differentiate the matching mx::fast function (or composed ops)
// on the primals (its CPU fallback is differentiable), so training through
// them works.
#pragma once

#include <functional>
#include <vector>

#include "mlx/primitives.h"

namespace mtplx {

namespace mx = mlx::core;

using ReferenceFn =
    std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

// A primitive whose gradients are those of a composed reference of its math
// on all of its inputs (mx::vjp / mx::jvp of reference()).
class ReferenceDifferentiable : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override;

 protected:
  virtual ReferenceFn reference() = 0;
};

// Inputs: x [..., D] (float32/float16/bfloat16, any strides), then optionally
// weight [D] (same dtype). Output: x's shape and dtype, row contiguous.
class FusedRMSNorm : public ReferenceDifferentiable {
 public:
  FusedRMSNorm(mx::Stream stream, float eps, bool has_weight)
      : ReferenceDifferentiable(stream), eps_(eps), has_weight_(has_weight) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "FusedRMSNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  float eps() const {
    return eps_;
  }
  bool has_weight() const {
    return has_weight_;
  }

 protected:
  ReferenceFn reference() override;

 private:
  float eps_;
  bool has_weight_;
};

// Inputs: x [B, ..., T, D] (ndim >= 3, float32/float16/bfloat16, any
// strides), offset int32 of size 1 or B (position of x's first row, per
// batch entry). Output: x's shape and dtype, row contiguous.
class FusedRoPE : public mx::UnaryPrimitive {
 public:
  FusedRoPE(
      mx::Stream stream,
      int dims,
      bool traditional,
      float base,
      float scale)
      : mx::UnaryPrimitive(stream),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override;

  const char* name() const override {
    return "FusedRoPE";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  int dims() const {
    return dims_;
  }
  bool traditional() const {
    return traditional_;
  }
  float base() const {
    return base_;
  }
  float scale() const {
    return scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

enum class AttentionMask : int {
  kNone = 0,
  kCausal = 1, // bottom-right aligned: query t sees keys s <= t + S - T
  kArray = 2, // bool (keep where true) or additive, in the output dtype
};

// Inputs: q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (one float
// dtype, any strides; Hq a multiple of Hkv), then for kArray the mask,
// broadcastable to [B, Hq, T, S] (any strides). Output [B, Hq, T, Dv], row
// contiguous.
class FusedAttention : public mx::UnaryPrimitive {
 public:
  FusedAttention(mx::Stream stream, float scale, AttentionMask mask)
      : mx::UnaryPrimitive(stream), scale_(scale), mask_(mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override;

  const char* name() const override {
    return "FusedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  float scale() const {
    return scale_;
  }
  AttentionMask mask() const {
    return mask_;
  }

 private:
  float scale_;
  AttentionMask mask_;
};

// Inputs: q [B, Hq, T, D] (float dtype, any strides); the keys as MLX's
// affine quantization along D (mx.quantize, mlx-lm's QuantizedKVCache
// layout): packed uint32 [B, Hkv, S, D * bits / 32], scales and biases
// [B, Hkv, S, D / group_size] (one float dtype); the values likewise with
// Dv; then for kArray the mask (as FusedAttention's). Output [B, Hq, T, Dv]
// in q's dtype, row contiguous.
class FusedQuantizedAttention : public mx::UnaryPrimitive {
 public:
  FusedQuantizedAttention(
      mx::Stream stream,
      float scale,
      AttentionMask mask,
      int bits,
      int group_size)
      : mx::UnaryPrimitive(stream),
        scale_(scale),
        mask_(mask),
        bits_(bits),
        group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "FusedQuantizedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  AttentionMask mask_;
  int bits_;
  int group_size_;
};

// Inputs: gate, x (same shape and float dtype, any strides). Output:
// silu(gate) * x, their shape and dtype, row contiguous.
class FusedSwiGLU : public ReferenceDifferentiable {
 public:
  explicit FusedSwiGLU(mx::Stream stream) : ReferenceDifferentiable(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "FusedSwiGLU";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 protected:
  ReferenceFn reference() override;
};

} // namespace mtplx
