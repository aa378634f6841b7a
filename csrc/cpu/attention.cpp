// eval_cpu of FusedAttention: the shared segment kernel
// (cpu/attention_kernel.h) over float keys and values, read in place where
// they are float32 rows with unit stride and a width that is a multiple of
// 8, else widened per segment into float32 rows.
//
// Masking follows mx::fast's fallback: a bool (or causal) mask replaces a
// score by the dtype's lowest finite value, so a fully masked row averages
// the values uniformly; an additive mask is added to the score. A row whose
// maximum score is not finite (all -inf, +inf) or that holds a NaN score is
// written as NaN, as the fallback's softmax yields.
//
// Keys before a job's first visible key or after its last (a bool or causal
// mask) get weight exactly 0 in the fallback and are not read here: with a
// fixed-capacity ragged KV cache most slots lie past every stream's end. (So
// a NaN in such a masked-out value row does not reach the output, where the
// fallback's 0 * NaN would.)
#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu/attention_kernel.h"
#include "fused_primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtplx {

namespace {

using namespace cpu;

// Keys and values of the call's float dtype, any strides.
struct FloatSource {
  mx::Dtype dtype = mx::float32;
  const void* k;
  int64_t ks[4];
  const void* v;
  int64_t vs[4];
  int D, Dv, Dp, Dvp;

  // The segment's rows as float32 rows `padded` wide: the array itself
  // where it already is that, else a widened copy in `buf` (zero padded).
  template <class S>
  static const float* rows_of(
      const void* data,
      const int64_t* st,
      const SegmentAt& at,
      int width,
      int padded,
      std::vector<float>& buf,
      int64_t& row) {
    using bits_t = typename S::bits_t;
    const bits_t* base =
        static_cast<const bits_t*>(data) + at.b * st[0] + at.g * st[1];
    if (std::is_same_v<S, F32> && st[3] == 1 && width == padded) {
      row = st[2];
      return reinterpret_cast<const float*>(base + at.a * st[2]);
    }
    buf.resize(size_t(at.e - at.a) * padded);
    for (int s = at.a; s < at.e; ++s) {
      float* dst = buf.data() + int64_t(s - at.a) * padded;
      load_row<S>(base + s * st[2], st[3], width, dst);
      std::fill(dst + width, dst + padded, 0.0f);
    }
    row = padded;
    return buf.data();
  }

  KVRows rows(const SegmentAt& at, UnitScratch& sc) const {
    KVRows r;
    with_float_dtype(dtype, [&]<class S>() __attribute__((always_inline)) {
      r.K = rows_of<S>(k, ks, at, D, Dp, sc.kbuf, r.k_row);
      r.V = rows_of<S>(v, vs, at, Dv, Dvp, sc.vbuf, r.v_row);
    });
    return r;
  }
};

// One unit of a planned call, compiled for x86-64-v3 where the CPU has it.
MTPLX_ATTENTION_CLONES void unit_cpu(
    const Geometry& G,
    AttentionPlan& plan,
    const FloatSource& src,
    const MaskView& mask,
    AttentionMask kind,
    int u) {
  with_float_dtype(src.dtype, [&]<class S>() __attribute__((always_inline)) {
    run_unit<S>(G, plan, src, mask, kind, u);
  });
}

void attention_cpu(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array* mask,
    AttentionMask kind,
    float scale,
    mx::array& out) {
  const Geometry G = geometry_of(q, k.shape(1), k.shape(2), v.shape(3));
  if (out.size() == 0) {
    return;
  }
  FloatSource src;
  QueryView qv;
  src.dtype = q.dtype();
  src.k = k.data<void>();
  src.v = v.data<void>();
  qv.q = q.data<void>();
  for (int i = 0; i < 4; ++i) {
    qv.qs[i] = q.strides()[i];
    src.ks[i] = k.strides()[i];
    src.vs[i] = v.strides()[i];
  }
  src.D = G.D;
  src.Dv = G.Dv;
  src.Dp = G.Dp;
  src.Dvp = G.Dvp;
  const MaskView mv(mask);
  void* o = out.data<void>();
  run_attention(
      src.dtype,
      G,
      qv,
      mv,
      kind,
      scale,
      [&](const Geometry& Gc, AttentionPlan& plan, int u) {
        unit_cpu(Gc, plan, src, mv, kind, u);
      },
      [&](const Geometry& Gc, AttentionPlan& plan, int j) {
        merge_cpu(src.dtype, Gc, plan, o, j);
      });
}

} // namespace

namespace cpu {

MTPLX_ATTENTION_CLONES void merge_cpu(
    mx::Dtype dtype,
    const Geometry& G,
    const AttentionPlan& plan,
    void* out,
    int j) {
  with_float_dtype(dtype, [&]<class S>() __attribute__((always_inline)) {
    run_merge<S>(G, plan, out, j);
  });
}

} // namespace cpu

void FusedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [kind = mask_, scale = scale_](
                 std::vector<mx::array>& in, mx::array& out) {
    const mx::array* mask = in.size() > 3 ? &in[3] : nullptr;
    attention_cpu(in[0], in[1], in[2], mask, kind, scale, out);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
