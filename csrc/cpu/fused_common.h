// Helpers shared by the CPU kernels of the fused ops (rms_norm, rope,
// attention, swiglu): float32 loads and stores of the three float dtypes,
// strided row addressing, 8-lane float vectors and their exp (GCC/Clang
// vector extensions: SSE2 in the baseline build, AVX2 in the clone picked at
// load time). Also the encoder glue every single-output eval_cpu shares
// (dispatch_cpu).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/half_bits.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/types/half_types.h"

// Portable wheels keep a baseline build; on x86-64 an AVX2 clone is picked at
// load time where the CPU has it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__)
#define MTPLX_FUSED_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MTPLX_FUSED_CLONES
#endif
#define MTPLX_FUSED_INLINE inline __attribute__((always_inline))

namespace mtplx::cpu {

namespace mx = mlx::core;

// Weak copies of arrays for a dispatched task: the encoder's registration
// keeps the buffers alive until the task has run.
inline std::vector<mx::array> weak_copies(const std::vector<mx::array>& arrays) {
  std::vector<mx::array> out;
  out.reserve(arrays.size());
  for (auto& a : arrays) {
    out.push_back(mx::array::unsafe_weak_copy(a));
  }
  return out;
}

// The eval_cpu glue of a single-output primitive: allocates `out`,
// registers every input and `out` with the stream's CPU encoder and
// dispatches job(in, out) on weak copies of them.
template <class Job>
void dispatch_cpu(
    const mx::Stream& stream,
    const std::vector<mx::array>& inputs,
    mx::array& out,
    Job&& job) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  enc.dispatch([in = weak_copies(inputs),
                out = mx::array::unsafe_weak_copy(out),
                job = std::forward<Job>(job)]() mutable { job(in, out); });
}

// The same for a primitive with several outputs: job(in, outs).
template <class Job>
void dispatch_cpu_outputs(
    const mx::Stream& stream,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    Job&& job) {
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
  }
  enc.dispatch([in = weak_copies(inputs),
                out = weak_copies(outputs),
                job = std::forward<Job>(job)]() mutable { job(in, out); });
}

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
constexpr int kLanes = 8;

MTPLX_FUSED_INLINE int round_up_lanes(int n) {
  return (n + kLanes - 1) / kLanes * kLanes;
}

MTPLX_FUSED_INLINE vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

MTPLX_FUSED_INLINE void store8(float* p, vf8 v) {
  std::memcpy(p, &v, sizeof(v));
}

MTPLX_FUSED_INLINE float hsum8(vf8 v) {
  float a = (v[0] + v[4]) + (v[1] + v[5]);
  float b = (v[2] + v[6]) + (v[3] + v[7]);
  return a + b;
}

// exp(x) for x <= 0 or -inf, 8 lanes: k = round(x / ln 2), Cody-Waite
// reduction and a degree-7 Taylor polynomial (|r| <= ln 2 / 2, relative
// error below 1e-8 before rounding). exp(x) < 2^-126 flushes to 0.
MTPLX_FUSED_INLINE vf8 exp_nonpos8(vf8 x) {
  const vi8 under = x < -87.0f;
  x = under ? vf8{} - 87.0f : x;
  const vf8 shift = vf8{} + 12582912.0f; // 1.5 * 2^23: round to integer
  vf8 kf = x * 1.44269504088896341f + shift;
  const vi8 k = (vi8)kf - (vi8)shift;
  kf -= shift;
  const vf8 r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
  vf8 p = vf8{} + (1.0f / 5040.0f);
  p = p * r + (1.0f / 720.0f);
  p = p * r + (1.0f / 120.0f);
  p = p * r + (1.0f / 24.0f);
  p = p * r + (1.0f / 6.0f);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vf8 two_k = (vf8)((k + 127) << 23);
  return under ? vf8{} : p * two_k;
}

// Storage types: float, or the 16-bit bit patterns of float16 / bfloat16.
// Stores round to nearest even exactly as MLX's own casts do.
struct F32 {
  using bits_t = float;
  static MTPLX_FUSED_INLINE float load(float v) {
    return v;
  }
  static MTPLX_FUSED_INLINE float store(float v) {
    return v;
  }
  static MTPLX_FUSED_INLINE float round(float v) {
    return v;
  }
};

struct F16 {
  using bits_t = uint16_t;
  static MTPLX_FUSED_INLINE float load(uint16_t h) {
    return half_bits_to_float(h);
  }
  static MTPLX_FUSED_INLINE uint16_t store(float v) {
    return std::bit_cast<uint16_t>(mx::float16_t(v));
  }
  static MTPLX_FUSED_INLINE float round(float v) {
    return load(store(v));
  }
};

struct BF16 {
  using bits_t = uint16_t;
  static MTPLX_FUSED_INLINE float load(uint16_t b) {
    return bf16_bits_to_float(b);
  }
  static MTPLX_FUSED_INLINE uint16_t store(float v) {
    return std::bit_cast<uint16_t>(mx::bfloat16_t(v));
  }
  static MTPLX_FUSED_INLINE float round(float v) {
    return load(store(v));
  }
};

// Calls f.template operator()<S>() with S the storage type of `dtype`
// (float32, float16, else bfloat16). Give f __attribute__((always_inline))
// where the caller is a target clone, so the work compiles for its target.
template <class F>
MTPLX_FUSED_INLINE void with_float_dtype(mx::Dtype dtype, F&& f) {
  if (dtype == mx::float32) {
    f.template operator()<F32>();
  } else if (dtype == mx::float16) {
    f.template operator()<F16>();
  } else {
    f.template operator()<BF16>();
  }
}

// Widens n elements spaced `stride` apart into dst (float32).
template <class S>
MTPLX_FUSED_INLINE void
load_row(const typename S::bits_t* src, int64_t stride, int n, float* dst) {
  if (stride == 1) {
    for (int i = 0; i < n; ++i) {
      dst[i] = S::load(src[i]);
    }
  } else {
    for (int i = 0; i < n; ++i) {
      dst[i] = S::load(src[i * stride]);
    }
  }
}

// Element offsets of the rows of an array (all axes but the last, row-major
// logical order) under its strides.
class RowWalker {
 public:
  explicit RowWalker(const mx::array& a) {
    int nd = a.ndim();
    for (int i = 0; i + 1 < nd; ++i) {
      shape_.push_back(a.shape(i));
      strides_.push_back(a.strides()[i]);
    }
    col_stride_ = nd > 0 ? int64_t(a.strides()[nd - 1]) : 1;
  }

  int64_t offset(int64_t row) const {
    int64_t off = 0;
    for (int i = int(shape_.size()) - 1; i >= 0; --i) {
      int64_t n = shape_[i];
      off += (row % n) * strides_[i];
      row /= n;
    }
    return off;
  }

  int64_t col_stride() const {
    return col_stride_;
  }

 private:
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  int64_t col_stride_;
};

} // namespace mtplx::cpu
