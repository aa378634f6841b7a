#include "state_ops.h"

#include <string>

#include "arg_checks.h"
#include "gated_delta_rules.h"
#include "mtplx_rules.h"
#include "state_primitives.h"

namespace mtplx {

std::vector<mx::array> snapshot_state(
    const std::vector<mx::array>& leaves,
    mx::StreamOrDevice s) {
  if (leaves.empty()) {
    return {};
  }
  auto st = mx::to_stream(s);
  std::vector<mx::array> inputs;
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  inputs.reserve(leaves.size());
  for (auto& a : leaves) {
    inputs.push_back(mx::contiguous(a, false, st));
    shapes.push_back(a.shape());
    dtypes.push_back(a.dtype());
  }
  return mx::array::make_arrays(
      std::move(shapes),
      std::move(dtypes),
      std::make_shared<SnapshotState>(st),
      std::move(inputs));
}

std::vector<mx::Shape> SnapshotState::output_shapes(
    const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> out;
  for (auto& a : inputs) {
    out.push_back(a.shape());
  }
  return out;
}

std::vector<mx::array> restore_state(
    const std::vector<mx::array>& live,
    const std::vector<mx::array>& snapshot,
    const std::optional<mx::array>& row_mask,
    mx::StreamOrDevice s) {
  if (live.size() != snapshot.size()) {
    bad_arg(
        "snapshot has " + std::to_string(snapshot.size()) +
        " leaves but live has " + std::to_string(live.size()));
  }
  if (live.empty()) {
    return {};
  }
  for (size_t i = 0; i < live.size(); ++i) {
    if (live[i].shape() != snapshot[i].shape()) {
      bad_arg(
          "snapshot[" + std::to_string(i) + "] has shape " +
          shape_str(snapshot[i].shape()) + " but live[" + std::to_string(i) +
          "] has shape " + shape_str(live[i].shape()));
    }
    if (live[i].dtype() != snapshot[i].dtype()) {
      bad_arg(
          "snapshot[" + std::to_string(i) + "] and live[" + std::to_string(i) +
          "] have different dtypes");
    }
  }
  if (row_mask) {
    auto& m = *row_mask;
    if (m.ndim() != 1) {
      bad_arg("row_mask must have shape [B], got " + shape_str(m.shape()));
    }
    if (m.dtype() != mx::bool_) {
      bad_arg("row_mask must be a bool array");
    }
    for (size_t i = 0; i < live.size(); ++i) {
      if (live[i].ndim() < 1 || live[i].shape(0) != m.shape(0)) {
        bad_arg(
            "live[" + std::to_string(i) + "] has shape " +
            shape_str(live[i].shape()) + ", whose batch size differs from " +
            "row_mask's " + std::to_string(m.shape(0)));
      }
    }
  }
  auto st = mx::to_stream(s);
  std::vector<mx::array> inputs;
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (auto& a : live) {
    inputs.push_back(mx::contiguous(a, false, st));
    shapes.push_back(a.shape());
    dtypes.push_back(a.dtype());
  }
  for (auto& a : snapshot) {
    inputs.push_back(mx::contiguous(a, false, st));
  }
  if (row_mask) {
    inputs.push_back(mx::contiguous(*row_mask, false, st));
  }
  return mx::array::make_arrays(
      std::move(shapes),
      std::move(dtypes),
      std::make_shared<RestoreState>(
          st, static_cast<int>(live.size()), row_mask.has_value()),
      std::move(inputs));
}

bool RestoreState::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RestoreState&>(other);
  return num_leaves_ == o.num_leaves_ && masked_ == o.masked_;
}

std::vector<mx::Shape> RestoreState::output_shapes(
    const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> out;
  for (int i = 0; i < num_leaves_; ++i) {
    out.push_back(inputs[i].shape());
  }
  return out;
}

namespace {

void check_float(const char* name, const mx::array& a) {
  if (!is_logit_dtype(a.dtype())) {
    bad_arg(std::string(name) + " must be float32, float16 or bfloat16");
  }
}

void check_shape(
    const char* name,
    const mx::array& a,
    const mx::Shape& want,
    const char* layout) {
  if (a.shape() != want) {
    bad_arg(
        std::string(name) + " must have shape " + layout + " = " +
        shape_str(want) + ", got " + shape_str(a.shape()));
  }
}

} // namespace

std::vector<mx::array> gated_delta_capture(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    mx::StreamOrDevice s) {
  if (q.ndim() != 4) {
    bad_arg("q must have shape [B, T, Hk, Dk], got " + shape_str(q.shape()));
  }
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  if (B < 1 || T < 1 || Hk < 1 || Dk < 1 || Dk > kGdMaxKeyDim) {
    bad_arg(
        "q must have shape [B, T, Hk, Dk] with B, T, Hk >= 1 and Dk in [1, " +
        std::to_string(kGdMaxKeyDim) + "], got " + shape_str(q.shape()));
  }
  check_shape("k", k, q.shape(), "[B, T, Hk, Dk]");
  if (v.ndim() != 4 || v.shape(0) != B || v.shape(1) != T || v.shape(2) < 1 ||
      v.shape(3) < 1) {
    bad_arg(
        "v must have shape [B, T, Hv, Dv] with B = " + std::to_string(B) +
        ", T = " + std::to_string(T) + " (as q), got " + shape_str(v.shape()));
  }
  const int Hv = v.shape(2), Dv = v.shape(3);
  if (Hv % Hk != 0) {
    bad_arg(
        "v's head count Hv = " + std::to_string(Hv) +
        " must be a multiple of q's Hk = " + std::to_string(Hk));
  }
  check_shape("g", g, {B, T, Hv}, "[B, T, Hv]");
  check_shape("beta", beta, {B, T, Hv}, "[B, T, Hv]");
  check_shape("state", state, {B, Hv, Dv, Dk}, "[B, Hv, Dv, Dk]");
  check_float("q", q);
  check_float("g", g);
  check_float("beta", beta);
  check_float("state", state);
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    bad_arg("q, k and v must have one dtype");
  }
  auto st = mx::to_stream(s);
  auto c = [&](const mx::array& a) { return mx::contiguous(a, false, st); };
  // Gates widen exactly to float32, which the kernels compute in.
  auto f32 = [&](const mx::array& a) {
    return c(a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, st));
  };
  return mx::array::make_arrays(
      {{B, T, Hv, Dv}, {B, T, Hv, Dv, Dk}},
      {q.dtype(), state.dtype()},
      std::make_shared<GatedDeltaCapture>(st),
      {c(q), c(k), c(v), f32(g), f32(beta), c(state)});
}

std::vector<mx::Shape> GatedDeltaCapture::output_shapes(
    const std::vector<mx::array>& inputs) {
  auto& q = inputs[0];
  auto& v = inputs[2];
  return {
      {q.shape(0), q.shape(1), v.shape(2), v.shape(3)},
      {q.shape(0), q.shape(1), v.shape(2), v.shape(3), q.shape(3)}};
}

} // namespace mtplx
