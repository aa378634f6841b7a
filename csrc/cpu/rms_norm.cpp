// eval_cpu of FusedRMSNorm: per row, y = to_T(x * rsqrt(mean(x^2) + eps))
// with the mean in float32, then to_T(y * w): the rounding steps of
// mx::fast::rms_norm's fallback.
#include <cmath>
#include <vector>

#include "cpu/fused_common.h"
#include "fused_primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtplx {

namespace {

using namespace cpu;

template <class S>
MTPLX_FUSED_INLINE void rms_norm_impl(
    const mx::array& x,
    const mx::array* w,
    float eps,
    mx::array& out) {
  using bits_t = typename S::bits_t;
  const int D = x.shape(-1);
  const int64_t rows = D > 0 ? int64_t(x.size() / D) : 0;
  if (rows == 0 || D == 0) {
    return;
  }
  const int Dp = round_up_lanes(D);
  std::vector<float> buf(Dp, 0.0f);
  std::vector<float> wf;
  if (w) {
    wf.resize(D);
    load_row<S>(w->data<bits_t>(), w->strides()[0], D, wf.data());
  }
  const RowWalker walk(x);
  const bits_t* xp = x.data<bits_t>();
  bits_t* op = out.data<bits_t>();
  const float inv_d = 1.0f / float(D);
  for (int64_t r = 0; r < rows; ++r) {
    load_row<S>(xp + walk.offset(r), walk.col_stride(), D, buf.data());
    vf8 acc0 = {}, acc1 = {};
    int i = 0;
    for (; i + 2 * kLanes <= Dp; i += 2 * kLanes) {
      vf8 a = load8(buf.data() + i), b = load8(buf.data() + i + kLanes);
      acc0 += a * a;
      acc1 += b * b;
    }
    for (; i < Dp; i += kLanes) {
      vf8 a = load8(buf.data() + i);
      acc0 += a * a;
    }
    const float n = 1.0f / std::sqrt(hsum8(acc0 + acc1) * inv_d + eps);
    bits_t* orow = op + r * D;
    if (w) {
      for (int d = 0; d < D; ++d) {
        orow[d] = S::store(S::round(buf[d] * n) * wf[d]);
      }
    } else {
      for (int d = 0; d < D; ++d) {
        orow[d] = S::store(buf[d] * n);
      }
    }
  }
}

MTPLX_FUSED_CLONES void rms_norm_cpu(
    const mx::array& x,
    const mx::array* w,
    float eps,
    mx::array& out) {
  if (x.dtype() == mx::float32) {
    rms_norm_impl<F32>(x, w, eps, out);
  } else if (x.dtype() == mx::float16) {
    rms_norm_impl<F16>(x, w, eps, out);
  } else {
    rms_norm_impl<BF16>(x, w, eps, out);
  }
}

} // namespace

void FusedRMSNorm::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [has_weight = has_weight_, eps = eps_](
                 std::vector<mx::array>& in, mx::array& out) {
    rms_norm_cpu(in[0], has_weight ? &in[1] : nullptr, eps, out);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
