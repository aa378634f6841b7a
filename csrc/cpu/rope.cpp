// eval_cpu of FusedRoPE, following mx::fast::rope's fallback: positions
// p = (t + offset) * scale and inverse frequencies exp(-i * log(base) / h),
// i < h = dims / 2, all in float32; theta = p * inv_freq. Non-traditional
// rotates the pairs (i, i + h), traditional the pairs (2i, 2i + 1); features
// from dims on pass through unchanged. The rotation runs in float32 and is
// rounded once to x's dtype.
#include <cmath>
#include <vector>

#include "cpu/fused_common.h"
#include "fused_primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtplx {

namespace {

using namespace cpu;

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
};

template <class S>
MTPLX_FUSED_INLINE void rope_impl(
    const mx::array& x,
    const mx::array& offset,
    const RopeParams& p,
    mx::array& out) {
  using bits_t = typename S::bits_t;
  const int nd = x.ndim();
  const int B = x.shape(0);
  const int T = x.shape(nd - 2);
  const int D = x.shape(nd - 1);
  const int64_t rows = D > 0 ? int64_t(x.size() / D) : 0;
  if (rows == 0) {
    return;
  }
  const int64_t per_batch = rows / B; // N * T rows per batch entry
  const int h = p.dims / 2;

  std::vector<float> inv_freq(h);
  const float coef = std::log(p.base) / float(h);
  for (int i = 0; i < h; ++i) {
    inv_freq[i] = std::exp(float(-i) * coef);
  }
  // cos / sin per (offset entry, t, i).
  const int n_off = int(offset.size());
  const int32_t* offs = offset.data<int32_t>();
  const int64_t off_stride = offset.ndim() == 1 ? offset.strides()[0] : 0;
  std::vector<float> cs(size_t(n_off) * T * h), sn(cs.size());
  for (int o = 0; o < n_off; ++o) {
    for (int t = 0; t < T; ++t) {
      const float pos = (float(t) + float(offs[o * off_stride])) * p.scale;
      float* c = cs.data() + (size_t(o) * T + t) * h;
      float* s = sn.data() + (size_t(o) * T + t) * h;
      for (int i = 0; i < h; ++i) {
        const float theta = pos * inv_freq[i];
        c[i] = std::cos(theta);
        s[i] = std::sin(theta);
      }
    }
  }

  const RowWalker walk(x);
  const int64_t cstride = walk.col_stride();
  const bits_t* xp = x.data<bits_t>();
  bits_t* op = out.data<bits_t>();
  std::vector<float> buf(D);
  for (int64_t r = 0; r < rows; ++r) {
    const int b = int(r / per_batch);
    const int t = int(r % T);
    const size_t tab = (size_t(n_off == 1 ? 0 : b) * T + t) * h;
    const float* c = cs.data() + tab;
    const float* s = sn.data() + tab;
    const bits_t* xr = xp + walk.offset(r);
    bits_t* orow = op + r * D;
    load_row<S>(xr, cstride, p.dims, buf.data());
    if (p.traditional) {
      for (int i = 0; i < h; ++i) {
        const float x1 = buf[2 * i], x2 = buf[2 * i + 1];
        orow[2 * i] = S::store(x1 * c[i] - x2 * s[i]);
        orow[2 * i + 1] = S::store(x1 * s[i] + x2 * c[i]);
      }
    } else {
      const float* x1 = buf.data();
      const float* x2 = buf.data() + h;
      for (int i = 0; i < h; ++i) {
        orow[i] = S::store(x1[i] * c[i] - x2[i] * s[i]);
        orow[h + i] = S::store(x1[i] * s[i] + x2[i] * c[i]);
      }
    }
    if (cstride == 1) {
      for (int d = p.dims; d < D; ++d) {
        orow[d] = xr[d];
      }
    } else {
      for (int d = p.dims; d < D; ++d) {
        orow[d] = xr[d * cstride];
      }
    }
  }
}

MTPLX_FUSED_CLONES void rope_cpu(
    const mx::array& x,
    const mx::array& offset,
    const RopeParams& p,
    mx::array& out) {
  if (x.dtype() == mx::float32) {
    rope_impl<F32>(x, offset, p, out);
  } else if (x.dtype() == mx::float16) {
    rope_impl<F16>(x, offset, p, out);
  } else {
    rope_impl<BF16>(x, offset, p, out);
  }
}

} // namespace

void FusedRoPE::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto job = [p = RopeParams{dims_, traditional_, base_, scale_}](
                 std::vector<mx::array>& in, mx::array& out) {
    rope_cpu(in[0], in[1], p, out);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
