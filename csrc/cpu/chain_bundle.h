// Writing a finished depth-K chain into its bundle row (greedy and sampled
// chains alike; layout in mtplx_rules.h).
#pragma once

#include <cstdint>

#include "mtplx_rules.h"

namespace mtplx::cpu {

// Writes a finished chain into its bundle row: n = kInvalid leaves every
// token column kInvalid.
inline void write_chain(
    int32_t* row,
    int K,
    int V,
    int64_t x0,
    int n,
    const int32_t* c) {
  row[kChainColX0] = (x0 >= 0 && x0 < V) ? int32_t(x0) : kInvalid;
  row[kChainColAccepted] = n;
  for (int j = 0; j <= K; ++j) {
    row[kChainColFirst + j] = (n >= 0 && j <= n) ? c[j] : kInvalid;
  }
}

} // namespace mtplx::cpu
