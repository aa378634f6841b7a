// Argument checks shared by the C++ ops: errors name the argument.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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

} // namespace mtplx
