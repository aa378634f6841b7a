// The per-row logit bias of the CPU row kernels: a row with a bias is read
// through a float32 copy holding float32(logit) + bias (the rule of
// python/mtplx_ext/sampling/reference.py), so every transform after it
// (penalties, temperature, top-k / top-p / min-p, argmax) sees the biased
// logits and the kernels' fast paths stay as they are. Rows without a bias
// entry inside [0, V) are read in place and cost nothing extra.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/half_bits.h"
#include "mlx/array.h"
#include "mlx/dtype.h"

namespace mtplx::cpu {

namespace mx = mlx::core;

// One row of a padded [B, M] bias: entry e adds values[e] to the logit of
// ids[e]; ids outside [0, V) add nothing; repeated ids add in entry order.
struct RowBias {
  const int32_t* ids = nullptr;
  const float* values = nullptr;
  int m = 0;

  // Row b of the (ids, values) inputs at in[first], in[first + 1]; an
  // empty bias when the primitive has none.
  static RowBias of(const std::vector<mx::array>& in, int first, bool has, int b) {
    if (!has) {
      return {};
    }
    const int M = in[first].shape(1);
    return {
        in[first].data<int32_t>() + size_t(b) * M,
        in[first + 1].data<float>() + size_t(b) * M,
        M};
  }

  bool any(int V) const {
    for (int e = 0; e < m; ++e) {
      if (ids[e] >= 0 && ids[e] < V) {
        return true;
      }
    }
    return false;
  }
};

// A logits row as the kernels read it: its bits and their dtype.
struct LogitRow {
  const void* data;
  mx::Dtype dtype;
};

// Row `row` (V logits of `dtype`) with `bias` added, in this thread's
// scratch `slot` (0..3; a later call with the same slot overwrites it), or
// the row itself when the bias touches nothing.
inline LogitRow
biased_row(const void* row, mx::Dtype dtype, int V, const RowBias& bias, int slot) {
  if (!bias.any(V)) {
    return {row, dtype};
  }
  thread_local std::vector<float> scratch[4];
  std::vector<float>& buf = scratch[slot];
  buf.resize(size_t(V));
  float* out = buf.data();
  if (dtype == mx::float32) {
    const float* x = static_cast<const float*>(row);
    std::copy(x, x + V, out);
  } else if (dtype == mx::float16) {
    const uint16_t* x = static_cast<const uint16_t*>(row);
    for (int j = 0; j < V; ++j) {
      out[j] = half_bits_to_float(x[j]);
    }
  } else {
    const uint16_t* x = static_cast<const uint16_t*>(row);
    for (int j = 0; j < V; ++j) {
      out[j] = bf16_bits_to_float(x[j]);
    }
  }
  for (int e = 0; e < bias.m; ++e) {
    const int32_t t = bias.ids[e];
    if (t >= 0 && t < V) {
      out[t] = out[t] + bias.values[e];
    }
  }
  return {out, mx::float32};
}

} // namespace mtplx::cpu
