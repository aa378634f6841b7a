// A software prefetch stream over the next block of a weight, advanced a few
// cache lines per vector step of the current block's loops: the next block
// arrives from memory while the current one is computed from cache. Shared
// by the BLAS shim's decode GEMM and the packed GEMM.
#pragma once

namespace mtplx {

// Locality: __builtin_prefetch's third argument (3: into L1, 2: into L2).
template <int Locality>
struct PrefetchStream {
  const char* p = nullptr;
  const char* end = nullptr;
  int per_step = 0;

  // Points the stream at [begin, end), spread over `steps` calls of step().
  inline void aim(const char* begin, const char* stop, long long steps) {
    p = begin;
    end = stop;
    per_step = int(((stop - begin) / 64 + steps - 1) / steps);
  }

  inline void step() {
    for (int q = 0; q < per_step && p < end; ++q, p += 64) {
      __builtin_prefetch(p, 0, Locality);
    }
  }
};

} // namespace mtplx
