#include "cpu/row_argmax.h"

// Portable wheels keep a baseline build; on x86-64 an AVX2 clone is picked at
// load time where the CPU has it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__)
#define MTPLX_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MTPLX_CLONES
#endif

namespace mtplx::cpu {

MTPLX_CLONES RowArgmax row_argmax_f32(const uint32_t* x, int n) {
  return row_argmax_f32_impl(reinterpret_cast<const float*>(x), n);
}

MTPLX_CLONES RowArgmax row_argmax_f16(const uint16_t* x, int n) {
  return row_argmax_16<F16Key>(x, n);
}

MTPLX_CLONES RowArgmax row_argmax_bf16(const uint16_t* x, int n) {
  return row_argmax_16<BF16Key>(x, n);
}

} // namespace mtplx::cpu
