// MLX primitives of recurrent state: snapshot / masked restore of state
// leaves and the gated-delta capture. eval_cpu lives in cpu/, eval_gpu in
// metal/ (or no_metal.cpp where MLX has no Metal backend).
#pragma once

#include <vector>

#include "mlx/primitives.h"

namespace mtplx {

namespace mx = mlx::core;

// Copies every input leaf into a fresh output of the same shape and dtype, in
// one primitive for the whole list.
class SnapshotState : public mx::Primitive {
 public:
  explicit SnapshotState(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "SnapshotState";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;
};

// Inputs: n live leaves, n snapshot leaves, then optionally a row mask [B]
// (bool). Output i is snapshot i where the mask is set (everywhere without a
// mask) and live i elsewhere.
class RestoreState : public mx::Primitive {
 public:
  RestoreState(mx::Stream stream, int num_leaves, bool masked)
      : mx::Primitive(stream), num_leaves_(num_leaves), masked_(masked) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "RestoreState";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  int num_leaves() const {
    return num_leaves_;
  }
  bool masked() const {
    return masked_;
  }

 private:
  int num_leaves_;
  bool masked_;
};

// Gated delta rule over a [B, T] chunk that also captures the recurrent state
// after every position (rules in metal/gated_delta_rules.h). Inputs, row
// contiguous: q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv] (one float dtype),
// g, beta [B, T, Hv] float32, state [B, Hv, Dv, Dk] (a float dtype).
// Outputs: y [B, T, Hv, Dv] in q's dtype, states [B, T, Hv, Dv, Dk] in the
// state's dtype (states[:, T - 1] is the chunk's final state).
class GatedDeltaCapture : public mx::Primitive {
 public:
  explicit GatedDeltaCapture(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "GatedDeltaCapture";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;
};

} // namespace mtplx
