// Test fixture, deliberately broken: each position's state is stored before
// the delta update (the decayed state, not the state after the token). A copy
// of metal/gated_delta.h with that one change; the emulator tests must catch
// it. Never built into the metallib.

#include <metal_stdlib>

#include "gated_delta_rules.h"

using namespace metal;

namespace mtplx {

template <typename InT, typename StT>
[[kernel]] void gated_delta_capture(
    const device InT* q [[buffer(0)]],
    const device InT* k [[buffer(1)]],
    const device InT* v [[buffer(2)]],
    const device float* g [[buffer(3)]],
    const device float* beta [[buffer(4)]],
    const device StT* state [[buffer(5)]],
    device InT* y [[buffer(6)]],
    device StT* states [[buffer(7)]],
    constant int& T [[buffer(8)]],
    constant int& Hk [[buffer(9)]],
    constant int& Hv [[buffer(10)]],
    constant int& Dk [[buffer(11)]],
    constant int& Dv [[buffer(12)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const int j = int(group.x) * kGdRowsPerGroup + int(sg);
  if (j >= Dv) {
    return; // the last group's spare rows: the whole simdgroup leaves
  }
  const int h = int(group.y);
  const int b = int(group.z);
  const int hk = h / (Hv / Hk);

  float s[kGdMaxPerLane];
  const ulong row0 = ((ulong(b) * Hv + h) * Dv + j) * ulong(Dk);
  for (int e = 0; e < kGdMaxPerLane; ++e) {
    const int i = int(lane) + e * kGdLanes;
    s[e] = i < Dk ? float(state[row0 + i]) : 0.0f;
  }
  for (int t = 0; t < T; ++t) {
    const ulong qk0 = ((ulong(b) * T + t) * Hk + hk) * ulong(Dk);
    const ulong gi = (ulong(b) * T + t) * Hv + h;
    const float gt = g[gi];
    float kv = 0.0f;
    for (int e = 0; e < kGdMaxPerLane; ++e) {
      const int i = int(lane) + e * kGdLanes;
      if (i < Dk) {
        s[e] = s[e] * gt;
        kv += s[e] * float(k[qk0 + i]);
      }
    }
    kv = simd_sum(kv);
    const float delta = gd_delta(float(v[gi * Dv + j]), kv, beta[gi]);
    float out = 0.0f;
    const ulong dst = gd_state_offset(b, t, h, j, T, Hv, Dv, Dk);
    for (int e = 0; e < kGdMaxPerLane; ++e) {
      const int i = int(lane) + e * kGdLanes;
      if (i < Dk) {
        states[dst + i] = static_cast<StT>(s[e]);
        s[e] = s[e] + float(k[qk0 + i]) * delta;
        out += s[e] * float(q[qk0 + i]);
      }
    }
    out = simd_sum(out);
    if (lane == 0) {
      y[gi * Dv + j] = static_cast<InT>(out);
    }
  }
}

} // namespace mtplx

template [[host_name("gated_delta_capture_float32_float32")]] [[kernel]]
decltype(mtplx::gated_delta_capture<float, float>)
    mtplx::gated_delta_capture<float, float>;
