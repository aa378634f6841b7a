// eval_cpu of GatedDeltaCapture: one job per (batch, value head) on the worker
// pool; each value row keeps its state row in float32 over the whole chunk
// (rules in metal/gated_delta_rules.h) and writes it after every position.
#include <algorithm>
#include <vector>

#include "cpu/fused_common.h"
#include "cpu/thread_pool.h"
#include "gated_delta_rules.h"
#include "mlx/backend/cpu/encoder.h"
#include "state_primitives.h"

namespace mtplx {

namespace {

using namespace cpu;

// Rough single-thread cost of one state element at one position (ns): the
// decay, two dot products, the update and the store.
constexpr double kGdNsPerElement = 0.6;
constexpr double kMinThreadNs = 30000.0;

template <class In, class St>
MTPLX_FUSED_INLINE void gated_delta_impl(
    const std::vector<mx::array>& in,
    std::vector<mx::array>& out) {
  using in_t = typename In::bits_t;
  using st_t = typename St::bits_t;
  const int B = in[0].shape(0), T = in[0].shape(1), Hk = in[0].shape(2);
  const int Dk = in[0].shape(3), Hv = in[2].shape(2), Dv = in[2].shape(3);
  const int group = Hv / Hk;
  const int Dp = round_up_lanes(Dk);
  const in_t* q = in[0].data<in_t>();
  const in_t* k = in[1].data<in_t>();
  const in_t* v = in[2].data<in_t>();
  const float* g = in[3].data<float>();
  const float* beta = in[4].data<float>();
  const st_t* s0 = in[5].data<st_t>();
  in_t* y = out[0].data<in_t>();
  st_t* states = out[1].data<st_t>();

  auto run = [&](int job) {
    const int b = job / Hv, h = job % Hv, hk = h / group;
    // q and k rows of this head at every position, widened and zero padded
    // to whole vectors (padding keeps the padded state lanes at 0).
    thread_local std::vector<float> qk;
    qk.assign(size_t(2) * T * Dp + Dp, 0.0f);
    float* qf = qk.data();
    float* kf = qf + size_t(T) * Dp;
    float* s = kf + size_t(T) * Dp;
    for (int t = 0; t < T; ++t) {
      const size_t off = ((size_t(b) * T + t) * Hk + hk) * Dk;
      load_row<In>(q + off, 1, Dk, qf + size_t(t) * Dp);
      load_row<In>(k + off, 1, Dk, kf + size_t(t) * Dp);
    }
    for (int j = 0; j < Dv; ++j) {
      load_row<St>(s0 + ((size_t(b) * Hv + h) * Dv + j) * Dk, 1, Dk, s);
      for (int t = 0; t < T; ++t) {
        const size_t gi = (size_t(b) * T + t) * Hv + h;
        const float gt = g[gi];
        const float* kt = kf + size_t(t) * Dp;
        const float* qt = qf + size_t(t) * Dp;
        vf8 acc = {};
        for (int i = 0; i < Dp; i += kLanes) {
          vf8 si = load8(s + i) * gt;
          store8(s + i, si);
          acc += si * load8(kt + i);
        }
        const float vj = In::load(v[gi * Dv + j]);
        const float delta = gd_delta(vj, hsum8(acc), beta[gi]);
        vf8 yacc = {};
        for (int i = 0; i < Dp; i += kLanes) {
          vf8 si = load8(s + i) + load8(kt + i) * delta;
          store8(s + i, si);
          yacc += si * load8(qt + i);
        }
        y[gi * Dv + j] = In::store(hsum8(yacc));
        st_t* dst = states + gd_state_offset(b, t, h, j, T, Hv, Dv, Dk);
        for (int i = 0; i < Dk; ++i) {
          dst[i] = St::store(s[i]);
        }
      }
    }
  };
  const int jobs = B * Hv;
  const double cost = double(jobs) * T * Dv * Dp * kGdNsPerElement;
  int threads = 1;
  if (jobs > 1 && cost >= 2 * kMinThreadNs) {
    threads = std::min<int>(
        {cpu_threads_or_one(), jobs, int(cost / kMinThreadNs)});
  }
  parallel_for(jobs, threads, run, cost);
}

template <class In>
MTPLX_FUSED_INLINE void gated_delta_state(
    const std::vector<mx::array>& in,
    std::vector<mx::array>& out) {
  const auto st = in[5].dtype();
  if (st == mx::float32) {
    gated_delta_impl<In, F32>(in, out);
  } else if (st == mx::float16) {
    gated_delta_impl<In, F16>(in, out);
  } else {
    gated_delta_impl<In, BF16>(in, out);
  }
}

MTPLX_FUSED_CLONES void gated_delta_cpu(
    const std::vector<mx::array>& in,
    std::vector<mx::array>& out) {
  const auto dt = in[0].dtype();
  if (dt == mx::float32) {
    gated_delta_state<F32>(in, out);
  } else if (dt == mx::float16) {
    gated_delta_state<F16>(in, out);
  } else {
    gated_delta_state<BF16>(in, out);
  }
}

} // namespace

void GatedDeltaCapture::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  cpu::dispatch_cpu_outputs(
      stream(),
      inputs,
      outputs,
      [](std::vector<mx::array>& in, std::vector<mx::array>& out) {
        gated_delta_cpu(in, out);
      });
}

} // namespace mtplx
