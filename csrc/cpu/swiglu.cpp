// eval_cpu of FusedSwiGLU: out = silu(gate) * x = gate * sigmoid(gate) * x,
// in float32 with a rounding to the output dtype after each of the three
// ops, as mlx-lm's compiled swiglu computes it. MLX's CPU backend compiles
// that graph into a scalar loop that calls libm's fma per element; this one
// runs 8 lanes at a time.
#include <type_traits>
#include <vector>

#include "cpu/fused_common.h"
#include "fused_primitives.h"

namespace mtplx {

namespace {

using namespace cpu;

// sigmoid from e = exp(-|g|) in (0, 1]: 1 / (1 + e) for g >= 0 and
// e / (1 + e) below, so nothing overflows; NaN stays NaN.
MTPLX_FUSED_INLINE vf8 sigmoid8(vf8 g) {
  const vi8 neg = g < 0.0f;
  const vf8 a = neg ? -g : g;
  const vf8 e = exp_nonpos8(vf8{} - a);
  const vf8 one = vf8{} + 1.0f;
  return (neg ? e : one) / (one + e);
}

template <class S>
MTPLX_FUSED_INLINE void swiglu_impl(
    const mx::array& gate,
    const mx::array& x,
    mx::array& out) {
  using bits_t = typename S::bits_t;
  const int D = out.ndim() > 0 ? out.shape(-1) : 1;
  const int64_t rows = D > 0 ? int64_t(out.size() / D) : 0;
  if (rows == 0) {
    return;
  }
  const int Dp = round_up_lanes(D);
  std::vector<float> gb(Dp, 0.0f), xb(Dp, 0.0f), ob(Dp, 0.0f);
  const RowWalker gw(gate), xw(x);
  const bits_t* gp = gate.data<bits_t>();
  const bits_t* xp = x.data<bits_t>();
  bits_t* op = out.data<bits_t>();
  for (int64_t r = 0; r < rows; ++r) {
    load_row<S>(gp + gw.offset(r), gw.col_stride(), D, gb.data());
    load_row<S>(xp + xw.offset(r), xw.col_stride(), D, xb.data());
    for (int i = 0; i < Dp; i += kLanes) {
      const vf8 g = load8(gb.data() + i);
      vf8 s = sigmoid8(g);
      if constexpr (!std::is_same_v<S, F32>) {
        // The per-op roundings of the half-precision graph.
        for (int l = 0; l < kLanes; ++l) {
          s[l] = S::round(S::round(g[l] * S::round(s[l])) * xb[i + l]);
        }
      } else {
        s = g * s * load8(xb.data() + i);
      }
      store8(ob.data() + i, s);
    }
    bits_t* orow = op + r * D;
    for (int d = 0; d < D; ++d) {
      orow[d] = S::store(ob[d]);
    }
  }
}

MTPLX_FUSED_CLONES void swiglu_cpu(
    const mx::array& gate,
    const mx::array& x,
    mx::array& out) {
  if (out.dtype() == mx::float32) {
    swiglu_impl<F32>(gate, x, out);
  } else if (out.dtype() == mx::float16) {
    swiglu_impl<F16>(gate, x, out);
  } else {
    swiglu_impl<BF16>(gate, x, out);
  }
}

} // namespace

void FusedSwiGLU::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [](std::vector<mx::array>& in, mx::array& out) {
    swiglu_cpu(in[0], in[1], out);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
