// 16-bit float bit patterns to float, shared by the CPU kernels that read
// float16 / bfloat16 logits or activations as raw bits.
#pragma once

#include <bit>
#include <cstdint>

namespace mtplx {

// Branch-free half -> float, exact for normals, subnormals, Inf and NaN.
inline __attribute__((always_inline)) float half_bits_to_float(uint16_t h) {
  uint32_t em = uint32_t(h & 0x7FFF) << 13;
  uint32_t exp = em & (0x7C00u << 13);
  uint32_t u = em + ((127 - 15) << 23);
  u += exp == (0x7C00u << 13) ? ((128 - 16) << 23) : 0u;
  float f = std::bit_cast<float>(exp == 0 ? u + (1u << 23) : u);
  f = exp == 0 ? f - std::bit_cast<float>(113u << 23) : f;
  uint32_t s = uint32_t(h & 0x8000) << 16;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | s);
}

// bfloat16 is the upper half of a float32.
inline __attribute__((always_inline)) float bf16_bits_to_float(uint16_t b) {
  return std::bit_cast<float>(uint32_t(b) << 16);
}

} // namespace mtplx
