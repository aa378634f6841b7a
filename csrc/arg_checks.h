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
