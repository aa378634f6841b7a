// eval_cpu of FusedAttention: per (batch, kv head), the query rows of the
// heads sharing that kv head run in blocks of up to four, so that each key
// and value row is loaded once per block. Scores, softmax and the weighted
// sum of values are float32; the output is rounded once to the dtype.
//
// Masking follows mx::fast's fallback: a bool (or causal) mask replaces a
// score by the dtype's lowest finite value, so a fully masked row averages
// the values uniformly; an additive mask is added to the score. A row whose
// maximum score is not finite (all -inf, +inf) or that holds a NaN score is
// written as NaN, as the fallback's softmax yields.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/fused_common.h"
#include "fused_primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtplx {

namespace {

using namespace cpu;

constexpr int kBlockRows = 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <class S>
constexpr float lowest_of() {
  if constexpr (std::is_same_v<S, F32>) {
    return std::numeric_limits<float>::lowest();
  } else if constexpr (std::is_same_v<S, F16>) {
    return -65504.0f;
  } else {
    return -3.38953139e38f; // -(2 - 2^-7) * 2^127, bfloat16's lowest
  }
}

struct Geometry {
  int B, Hq, T, D, Hkv, S, Dv, n_rep;
  int Dp, Dvp, Sp;
};

// Per-block scratch, reused across blocks.
struct Scratch {
  std::vector<float> q; // kBlockRows x Dp, scaled queries (zero padded)
  std::vector<float> scores; // kBlockRows x Sp
  std::vector<float> acc; // kBlockRows x Dvp
};

template <class S>
struct Inputs {
  using bits_t = typename S::bits_t;
  const bits_t* q;
  int64_t qs[4];
  const float* k; // rows of Dp (or k's own row stride when direct)
  int64_t k_row;
  const float* v;
  int64_t v_row;
  const void* mask; // bool or bits_t, nullptr if none
  bool bool_mask;
  int64_t ms[4]; // broadcast strides (0 on size-1 axes)
  bits_t* out;
};

template <class S, int R>
MTPLX_FUSED_INLINE void attend_block(
    const Geometry& G,
    const Inputs<S>& in,
    AttentionMask kind,
    float scale,
    int b,
    int g,
    int row0,
    Scratch& sc) {
  using bits_t = typename S::bits_t;
  constexpr float lowest = lowest_of<S>();
  int head[R], pos[R], limit[R];
  bool all_masked[R];
  int lmax = 0;
  for (int r = 0; r < R; ++r) {
    const int i = row0 + r;
    pos[r] = i / G.n_rep;
    head[r] = g * G.n_rep + i % G.n_rep;
    const bits_t* qr =
        in.q + b * in.qs[0] + head[r] * in.qs[1] + pos[r] * in.qs[2];
    float* qd = sc.q.data() + r * G.Dp;
    load_row<S>(qr, in.qs[3], G.D, qd);
    for (int d = 0; d < G.D; ++d) {
      qd[d] *= scale;
    }
    limit[r] = G.S;
    all_masked[r] = false;
    if (kind == AttentionMask::kCausal) {
      const int last = pos[r] + G.S - G.T; // last visible key
      all_masked[r] = last < 0;
      limit[r] = all_masked[r] ? G.S : std::min(last + 1, G.S);
    }
    lmax = std::max(lmax, limit[r]);
  }

  // Scores over the keys any row of the block can see.
  for (int s = 0; s < lmax; ++s) {
    const float* kr = in.k + s * in.k_row;
    vf8 a[R];
    for (int r = 0; r < R; ++r) {
      a[r] = vf8{};
    }
    for (int c = 0; c < G.Dp; c += kLanes) {
      const vf8 kv = load8(kr + c);
      for (int r = 0; r < R; ++r) {
        a[r] += load8(sc.q.data() + r * G.Dp + c) * kv;
      }
    }
    for (int r = 0; r < R; ++r) {
      sc.scores[r * G.Sp + s] = hsum8(a[r]);
    }
  }

  const int lpad = round_up_lanes(lmax);
  float inv_sum[R];
  bool nan_row[R];
  for (int r = 0; r < R; ++r) {
    float* sr = sc.scores.data() + r * G.Sp;
    if (kind == AttentionMask::kCausal) {
      const int from = all_masked[r] ? 0 : limit[r];
      for (int s = from; s < lmax; ++s) {
        sr[s] = lowest;
      }
    } else if (kind == AttentionMask::kArray) {
      const char* mp = static_cast<const char*>(in.mask);
      const int64_t off = b * in.ms[0] + head[r] * in.ms[1] + pos[r] * in.ms[2];
      const int64_t st = in.ms[3];
      if (in.bool_mask) {
        const bool* m = reinterpret_cast<const bool*>(mp) + off;
        for (int s = 0; s < lmax; ++s) {
          sr[s] = m[s * st] ? sr[s] : lowest;
        }
      } else {
        const bits_t* m = reinterpret_cast<const bits_t*>(mp) + off;
        for (int s = 0; s < lmax; ++s) {
          sr[s] += S::load(m[s * st]);
        }
      }
    }
    for (int s = lmax; s < lpad; ++s) {
      sr[s] = kNegInf;
    }
    vf8 mv = vf8{} + kNegInf;
    vi8 nan = vi8{};
    for (int s = 0; s < lpad; s += kLanes) {
      const vf8 x = load8(sr + s);
      mv = x > mv ? x : mv;
      nan |= x != x;
    }
    float m = kNegInf;
    bool has_nan = false;
    for (int j = 0; j < kLanes; ++j) {
      m = std::max(m, mv[j]);
      has_nan |= nan[j] != 0;
    }
    nan_row[r] = has_nan || !std::isfinite(m);
    if (nan_row[r]) {
      // Keep the weighted sum finite; the row is overwritten with NaN.
      std::fill(sr, sr + lpad, 0.0f);
      inv_sum[r] = 0.0f;
      continue;
    }
    vf8 sum = vf8{};
    for (int s = 0; s < lpad; s += kLanes) {
      const vf8 e = exp_nonpos8(load8(sr + s) - m);
      store8(sr + s, e);
      sum += e;
    }
    inv_sum[r] = 1.0f / hsum8(sum);
  }

  // Weighted sum of the value rows.
  std::fill(sc.acc.begin(), sc.acc.begin() + R * G.Dvp, 0.0f);
  for (int s = 0; s < lmax; ++s) {
    const float* vr = in.v + s * in.v_row;
    float p[R];
    for (int r = 0; r < R; ++r) {
      p[r] = sc.scores[r * G.Sp + s];
    }
    for (int c = 0; c < G.Dvp; c += kLanes) {
      const vf8 vv = load8(vr + c);
      for (int r = 0; r < R; ++r) {
        float* a = sc.acc.data() + r * G.Dvp + c;
        store8(a, load8(a) + p[r] * vv);
      }
    }
  }

  for (int r = 0; r < R; ++r) {
    bits_t* o =
        in.out + ((int64_t(b) * G.Hq + head[r]) * G.T + pos[r]) * int64_t(G.Dv);
    const float* a = sc.acc.data() + r * G.Dvp;
    if (nan_row[r]) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int d = 0; d < G.Dv; ++d) {
        o[d] = S::store(nan);
      }
    } else {
      for (int d = 0; d < G.Dv; ++d) {
        o[d] = S::store(a[d] * inv_sum[r]);
      }
    }
  }
}

// Rows of keys or values of one (batch, kv head) as float32 rows a multiple
// of 8 wide: the array itself where it already is, else a widened copy.
template <class S>
MTPLX_FUSED_INLINE const float* kv_rows(
    const mx::array& a,
    int b,
    int g,
    int n,
    int width,
    int padded,
    std::vector<float>& buf,
    int64_t& row_stride) {
  using bits_t = typename S::bits_t;
  auto& st = a.strides();
  const bits_t* base = a.data<bits_t>() + b * st[0] + g * st[1];
  if (std::is_same_v<S, F32> && st[3] == 1 && width == padded) {
    row_stride = st[2];
    return reinterpret_cast<const float*>(base);
  }
  if (buf.size() < size_t(n) * padded) {
    buf.assign(size_t(n) * padded, 0.0f); // the padding stays zero
  }
  for (int s = 0; s < n; ++s) {
    load_row<S>(base + s * st[2], st[3], width, buf.data() + s * padded);
  }
  row_stride = padded;
  return buf.data();
}

template <class S>
MTPLX_FUSED_INLINE void attention_impl(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array* mask,
    AttentionMask kind,
    float scale,
    mx::array& out) {
  using bits_t = typename S::bits_t;
  Geometry G;
  G.B = q.shape(0);
  G.Hq = q.shape(1);
  G.T = q.shape(2);
  G.D = q.shape(3);
  G.Hkv = k.shape(1);
  G.S = k.shape(2);
  G.Dv = v.shape(3);
  G.n_rep = G.Hq / G.Hkv;
  G.Dp = round_up_lanes(G.D);
  G.Dvp = round_up_lanes(G.Dv);
  G.Sp = round_up_lanes(G.S);
  if (out.size() == 0) {
    return;
  }

  Inputs<S> in;
  in.q = q.data<bits_t>();
  for (int i = 0; i < 4; ++i) {
    in.qs[i] = q.strides()[i];
  }
  in.mask = nullptr;
  in.bool_mask = false;
  for (int i = 0; i < 4; ++i) {
    in.ms[i] = 0;
  }
  if (mask) {
    in.mask = mask->data<void>();
    in.bool_mask = mask->dtype() == mx::bool_;
    const int lead = 4 - int(mask->ndim());
    for (int i = 0; i < int(mask->ndim()); ++i) {
      in.ms[lead + i] = mask->shape(i) == 1 ? 0 : mask->strides()[i];
    }
  }
  in.out = out.data<bits_t>();

  Scratch sc;
  sc.q.assign(size_t(kBlockRows) * G.Dp, 0.0f);
  sc.scores.assign(size_t(kBlockRows) * G.Sp, 0.0f);
  sc.acc.assign(size_t(kBlockRows) * G.Dvp, 0.0f);
  std::vector<float> kbuf, vbuf;
  const int rows = G.n_rep * G.T; // query rows sharing one kv head
  for (int b = 0; b < G.B; ++b) {
    for (int g = 0; g < G.Hkv; ++g) {
      in.k = kv_rows<S>(k, b, g, G.S, G.D, G.Dp, kbuf, in.k_row);
      in.v = kv_rows<S>(v, b, g, G.S, G.Dv, G.Dvp, vbuf, in.v_row);
      int row0 = 0;
      for (; row0 + kBlockRows <= rows; row0 += kBlockRows) {
        attend_block<S, kBlockRows>(G, in, kind, scale, b, g, row0, sc);
      }
      switch (rows - row0) {
        case 3:
          attend_block<S, 3>(G, in, kind, scale, b, g, row0, sc);
          break;
        case 2:
          attend_block<S, 2>(G, in, kind, scale, b, g, row0, sc);
          break;
        case 1:
          attend_block<S, 1>(G, in, kind, scale, b, g, row0, sc);
          break;
        default:
          break;
      }
    }
  }
}

MTPLX_FUSED_CLONES void attention_cpu(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array* mask,
    AttentionMask kind,
    float scale,
    mx::array& out) {
  if (q.dtype() == mx::float32) {
    attention_impl<F32>(q, k, v, mask, kind, scale, out);
  } else if (q.dtype() == mx::float16) {
    attention_impl<F16>(q, k, v, mask, kind, scale, out);
  } else {
    attention_impl<BF16>(q, k, v, mask, kind, scale, out);
  }
}

} // namespace

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
