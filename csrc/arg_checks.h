// Argument checks shared by the C++ ops: errors name the argument.
#pragma once

#include <climits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

namespace mtplx {

namespace mx = mlx::core;

[[noreturn]] inline void bad_arg(const std::string& msg) {
  throw std::invalid_argument(msg);
}

// "(2, 3)" / "(4,)": shapes as Python prints them.
inline std::string shape_str(const mx::Shape& shape) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    os << (i ? ", " : "") << shape[i];
  }
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

inline bool is_logit_dtype(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// The verification forward's logits: [B, 2, V] with B, V >= 1, a logit dtype.
inline void check_verify_logits(const mx::array& verify_logits) {
  if (verify_logits.ndim() != 3 || verify_logits.shape(1) != 2) {
    bad_arg(
        "verify_logits must have shape [B, 2, V], got " +
        shape_str(verify_logits.shape()));
  }
  if (!is_logit_dtype(verify_logits.dtype())) {
    bad_arg("verify_logits must be float32, float16 or bfloat16");
  }
  if (verify_logits.shape(0) < 1 || verify_logits.shape(2) < 1) {
    bad_arg(
        "verify_logits must have B >= 1 and V >= 1, got " +
        shape_str(verify_logits.shape()));
  }
}

// The logits of a depth-K verification forward: [B, K + 1, V] with
// K in [1, kMaxChainDrafts] (max_drafts), B, V >= 1, a logit dtype.
// Returns K.
inline int check_chain_logits(const mx::array& logits, int max_drafts) {
  if (logits.ndim() != 3) {
    bad_arg(
        "verify_logits must have shape [B, K + 1, V], got " +
        shape_str(logits.shape()));
  }
  const int K = logits.shape(1) - 1;
  if (K < 1 || K > max_drafts) {
    bad_arg(
        "verify_logits must have shape [B, K + 1, V] with K in [1, " +
        std::to_string(max_drafts) + "], got " + shape_str(logits.shape()));
  }
  if (!is_logit_dtype(logits.dtype())) {
    bad_arg("verify_logits must be float32, float16 or bfloat16");
  }
  if (logits.shape(0) < 1 || logits.shape(2) < 1) {
    bad_arg(
        "verify_logits must have B >= 1 and V >= 1, got " +
        shape_str(logits.shape()));
  }
  return K;
}

// Token ids are read as int32 or int64; narrower ints widen losslessly, so no
// id can wrap into the vocabulary.
inline mx::array
token_ids(const char* name, const mx::array& a, mx::Stream st) {
  if (!mx::issubdtype(a.dtype(), mx::integer)) {
    bad_arg(std::string(name) + " must have an integer dtype");
  }
  auto t = (a.dtype() == mx::int32 || a.dtype() == mx::int64)
      ? a
      : mx::astype(a, mx::int64, st);
  return mx::contiguous(t, false, st);
}

// The dense [B, V] float32 form of a padded bias (ids [B, M] int32, values
// [B, M] float32): row b holds the sum of its entries' values at their ids;
// ids outside [0, V) add nothing. What the Metal kernels read.
inline mx::array dense_logit_bias(
    const mx::array& ids,
    const mx::array& values,
    int V,
    mx::Stream st) {
  const int B = ids.shape(0);
  const int M = ids.shape(1);
  auto in_vocab = mx::logical_and(
      mx::greater_equal(ids, mx::array(0, mx::int32), st),
      mx::less(ids, mx::array(V, mx::int32), st),
      st);
  auto cols = mx::where(in_vocab, ids, mx::array(0, mx::int32), st);
  auto adds = mx::where(in_vocab, values, mx::array(0.0f, mx::float32), st);
  auto rows = mx::broadcast_to(
      mx::reshape(mx::arange(B, mx::int32, st), {B, 1}, st), {B, M}, st);
  auto dense = mx::scatter_add(
      mx::zeros({B, V}, mx::float32, st),
      {rows, cols},
      mx::reshape(adds, {B, M, 1, 1}, st),
      {0, 1},
      st);
  return mx::contiguous(dense, false, st);
}

// A padded per-row logit bias: ids [B, M] (integer; an id outside [0, V)
// adds nothing, so -1 pads a row) and values [B, M] (floating), M >= 1.
// Both or neither. Returns the primitive's bias inputs, or an empty vector
// without a bias: on the CPU {ids int32, values float32}, contiguous (the
// row kernels read the entries); on the GPU one dense [B, V] float32 row of
// biases per stream (entries scattered and summed; the Metal kernels read
// bias[t] beside logit t). Ids wider than int32 are clipped into
// [-1, 2**31 - 1] first: a cast alone could wrap an id into the vocabulary.
inline std::vector<mx::array> logit_bias_inputs(
    const std::optional<mx::array>& ids,
    const std::optional<mx::array>& values,
    int B,
    int V,
    mx::Stream st) {
  if (!ids && !values) {
    return {};
  }
  if (!ids || !values) {
    bad_arg(
        "logit_bias needs both logit_bias_ids and logit_bias_values (or "
        "neither)");
  }
  const mx::array& i = *ids;
  const mx::array& v = *values;
  if (i.ndim() != 2 || i.shape(0) != B || i.shape(1) < 1) {
    bad_arg(
        "logit_bias_ids must have shape [B, M] with B = " + std::to_string(B) +
        " and M >= 1, got " + shape_str(i.shape()));
  }
  if (v.shape() != i.shape()) {
    bad_arg(
        "logit_bias_values must have the shape of logit_bias_ids " +
        shape_str(i.shape()) + ", got " + shape_str(v.shape()));
  }
  if (!mx::issubdtype(i.dtype(), mx::integer)) {
    bad_arg("logit_bias_ids must have an integer dtype");
  }
  if (!mx::issubdtype(v.dtype(), mx::floating)) {
    bad_arg("logit_bias_values must be a floating array");
  }
  mx::array t = i;
  if (i.dtype() == mx::int64 || i.dtype() == mx::uint32 ||
      i.dtype() == mx::uint64) {
    auto wide = mx::astype(i, mx::int64, st);
    if (i.dtype() == mx::uint64) {
      // Huge unsigned ids would turn negative in int64: take them as "none".
      wide = mx::where(
          mx::greater(i, mx::array(uint64_t(INT32_MAX), mx::uint64), st),
          mx::array(int64_t(-1), mx::int64),
          wide,
          st);
    }
    t = mx::clip(
        wide,
        mx::array(int64_t(-1), mx::int64),
        mx::array(int64_t(INT32_MAX), mx::int64),
        st);
  }
  if (t.dtype() != mx::int32) {
    t = mx::astype(t, mx::int32, st);
  }
  auto f = v.dtype() == mx::float32 ? v : mx::astype(v, mx::float32, st);
  if (st.device == mx::Device::cpu) {
    return {mx::contiguous(t, false, st), mx::contiguous(f, false, st)};
  }
  return {dense_logit_bias(t, f, V, st)};
}

} // namespace mtplx
