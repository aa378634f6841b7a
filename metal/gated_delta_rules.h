// Rules of the gated delta rule capture (GatedDeltaCapture) shared by the CPU
// kernel (csrc/cpu/gated_delta.cpp), the Metal kernel (metal/gated_delta.h)
// and the op's argument checks (csrc/state_ops.cpp).
//
// Per batch b, value head h (key head h / (Hv / Hk)) and value row j, with the
// state row s = S[b, h, j, :] held in float32 for the whole chunk:
//   s     = s * g[b, t, h]
//   kv    = sum_i s[i] * k[b, t, hk, i]
//   delta = (v[b, t, h, j] - kv) * beta[b, t, h]
//   s     = s + k[b, t, hk, :] * delta
//   y[b, t, h, j]         = to_InT(sum_i s[i] * q[b, t, hk, i])
//   states[b, t, h, j, :] = to_StT(s)
// i.e. mlx-lm's gated_delta_update recurrence (scalar gate, no mask), which
// writes only the last state; the capture writes the state after every t.
#pragma once

#include "mtplx_rules.h"

namespace mtplx {

// Largest key head size: the Metal kernel keeps Dk / 32 (rounded up) state
// values per lane in registers.
MTPLX_CONST int kGdMaxKeyDim = 256;
MTPLX_CONST int kGdLanes = 32;
MTPLX_CONST int kGdMaxPerLane = kGdMaxKeyDim / kGdLanes;
// Value rows per Metal threadgroup (one simdgroup per row).
MTPLX_CONST int kGdRowsPerGroup = 4;

MTPLX_FN float gd_delta(float v, float kv, float beta) {
  return (v - kv) * beta;
}

// Element offset of states[b, t, h, j, 0] in a [B, T, Hv, Dv, Dk] buffer.
MTPLX_FN unsigned long gd_state_offset(
    int b,
    int t,
    int h,
    int j,
    int T,
    int Hv,
    int Dv,
    int Dk) {
  return (((static_cast<unsigned long>(b) * T + t) * Hv + h) * Dv + j) *
      static_cast<unsigned long>(Dk);
}

} // namespace mtplx
