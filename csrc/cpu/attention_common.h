// Pieces shared by the CPU attention kernels (FusedAttention over float KV,
// FusedQuantizedAttention over MLX-quantized KV): the geometry of a call,
// the mask view, the visible key span of each query row, and the masking +
// softmax of one row of scores. Both kernels run one job per (batch, kv
// head) whose rows are the query rows of the heads sharing that kv head.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/fused_common.h"
#include "fused_primitives.h"

namespace mtplx::cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The score a bool (or causal) mask gives a hidden key: the dtype's lowest
// finite value, as mx::fast's fallback does (a fully masked row then
// averages the values uniformly).
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
  int t0, Tr; // the query positions [t0, t0 + Tr) a pass covers
};

// A mask input: bool or bits of the attention dtype, broadcast strides (0 on
// size-1 axes); `data` is nullptr without one.
struct MaskView {
  const void* data = nullptr;
  bool is_bool = false;
  int64_t st[4] = {0, 0, 0, 0};

  MaskView() = default;
  explicit MaskView(const mx::array* mask) {
    if (mask == nullptr) {
      return;
    }
    data = mask->data<void>();
    is_bool = mask->dtype() == mx::bool_;
    const int lead = 4 - int(mask->ndim());
    for (int i = 0; i < int(mask->ndim()); ++i) {
      st[lead + i] = mask->shape(i) == 1 ? 0 : mask->strides()[i];
    }
  }
  int64_t offset(int b, int head, int pos) const {
    return b * st[0] + head * st[1] + pos * st[2];
  }
};

// One row of a job: its query head and position.
struct RowAt {
  int head, pos;
};

MTPLX_FUSED_INLINE RowAt row_at(const Geometry& G, int g, int i) {
  return {g * G.n_rep + i % G.n_rep, G.t0 + i / G.n_rep};
}

// The visible key span [first, last) of every row of a job. `blind` rows
// see no key.
struct Spans {
  std::vector<int> first, last;
  std::vector<char> blind;
  std::vector<char> dense; // a bool mask keeps every key of the span
  int lo = 0, hi = 0; // the union of the spans
};

// Spans of the rows of job (b, g) (causal: up to the row's position; bool
// mask: its first to its last kept key). A row that sees no key gets [0, S):
// the fallback averages all values.
inline void spans_of(
    const Geometry& G,
    const MaskView& mask,
    AttentionMask kind,
    int b,
    int g,
    int rows,
    Spans& sp) {
  sp.first.assign(rows, 0);
  sp.last.assign(rows, G.S);
  sp.blind.assign(rows, 0);
  sp.dense.assign(rows, 0);
  for (int i = 0; i < rows; ++i) {
    const RowAt at = row_at(G, g, i);
    if (i % G.n_rep != 0 && kind == AttentionMask::kArray && mask.st[1] == 0) {
      // The heads of a position share its mask row (broadcast over heads).
      const int same = i - i % G.n_rep;
      sp.first[i] = sp.first[same];
      sp.last[i] = sp.last[same];
      sp.blind[i] = sp.blind[same];
      sp.dense[i] = sp.dense[same];
      continue;
    }
    if (kind == AttentionMask::kCausal) {
      const int last = at.pos + G.S - G.T; // last visible key
      if (last >= 0) {
        sp.last[i] = std::min(last + 1, G.S);
      } else {
        sp.blind[i] = 1;
      }
    } else if (kind == AttentionMask::kArray && mask.is_bool) {
      const bool* m =
          static_cast<const bool*>(mask.data) + mask.offset(b, at.head, at.pos);
      const int64_t st = mask.st[3];
      int lo = 0, hi = G.S;
      while (lo < G.S && !m[lo * st]) {
        ++lo;
      }
      while (hi > lo && !m[(hi - 1) * st]) {
        --hi;
      }
      if (lo < hi) {
        sp.first[i] = lo;
        sp.last[i] = hi;
        int s = lo;
        while (s < hi && m[s * st]) {
          ++s;
        }
        sp.dense[i] = s == hi;
      } else {
        sp.blind[i] = 1;
      }
    }
  }
  sp.lo = *std::min_element(sp.first.begin(), sp.first.end());
  sp.hi = *std::max_element(sp.last.begin(), sp.last.end());
}

// Row i's scores sr[0, n8) of the keys [a, a + n8) of one segment: masks
// the keys [a, e) (causal or bool: the dtype's lowest value outside the
// row's span or where the mask is false; additive: added), gives the lanes
// from e on weight 0, and exponentiates against the segment's maximum, which
// it returns (kNegInf where no lane has any weight). `sum` gets the sum of
// the exponentials; `nan_flag` 1 where a score is NaN or the maximum is not
// finite (the row is then NaN; its weights here are zeroed).
template <class S>
MTPLX_FUSED_INLINE float segment_softmax(
    float* sr,
    const MaskView& mask,
    AttentionMask kind,
    const Spans& sp,
    int i,
    int bi,
    RowAt at,
    int a,
    int e,
    int n8,
    float& sum,
    float& nan_flag) {
  using bits_t = typename S::bits_t;
  constexpr float lowest = lowest_of<S>();
  const int n = e - a;
  const int first = sp.first[i], last = sp.last[i];
  if (kind == AttentionMask::kCausal) {
    const int from = sp.blind[i] ? 0 : std::clamp(last - a, 0, n);
    for (int j = from; j < n; ++j) {
      sr[j] = lowest;
    }
  } else if (kind == AttentionMask::kArray) {
    const int64_t off = mask.offset(bi, at.head, at.pos);
    const int64_t st = mask.st[3];
    if (mask.is_bool && sp.dense[i]) {
      // The mask keeps exactly the span: 8 lanes at a time.
      const vi8 iota = vi8{0, 1, 2, 3, 4, 5, 6, 7};
      const vf8 low = vf8{} + lowest;
      for (int j = 0; j < n; j += kLanes) {
        const vi8 s = iota + (a + j);
        const vi8 keep = (s >= first) & (s < last);
        store8(sr + j, keep ? load8(sr + j) : low);
      }
    } else if (mask.is_bool) {
      const bool* m = static_cast<const bool*>(mask.data) + off;
      for (int j = 0; j < n; ++j) {
        const int s = a + j;
        sr[j] = (s >= first && s < last && m[s * st]) ? sr[j] : lowest;
      }
    } else {
      const bits_t* m = static_cast<const bits_t*>(mask.data) + off;
      for (int j = 0; j < n; ++j) {
        sr[j] += S::load(m[(a + j) * st]);
      }
    }
  }
  for (int j = n; j < n8; ++j) {
    sr[j] = kNegInf;
  }
  vf8 mv = vf8{} + kNegInf;
  vi8 nan = vi8{};
  for (int j = 0; j < n8; j += kLanes) {
    const vf8 x = load8(sr + j);
    mv = x > mv ? x : mv;
    nan |= x != x;
  }
  float m = kNegInf;
  bool has_nan = false;
  for (int j = 0; j < kLanes; ++j) {
    m = std::max(m, mv[j]);
    has_nan |= nan[j] != 0;
  }
  nan_flag = (has_nan || m == std::numeric_limits<float>::infinity()) ? 1.0f : 0.0f;
  if (nan_flag != 0.0f || m == kNegInf) {
    std::fill(sr, sr + n8, 0.0f);
    sum = 0.0f;
    return m == kNegInf ? kNegInf : m;
  }
  vf8 acc = vf8{};
  for (int j = 0; j < n8; j += kLanes) {
    const vf8 x = exp_nonpos8(load8(sr + j) - m);
    store8(sr + j, x);
    acc += x;
  }
  sum = hsum8(acc);
  return m;
}

// Writes output row `at` of batch b: acc[0, Dv) * inv_sum, or NaN where
// inv_sum is 0 (a row whose softmax is not defined).
template <class S>
MTPLX_FUSED_INLINE void write_row(
    void* out,
    const Geometry& G,
    int b,
    RowAt at,
    int c0,
    int n,
    const float* acc,
    float inv_sum) {
  using bits_t = typename S::bits_t;
  bits_t* o = static_cast<bits_t*>(out) +
      ((int64_t(b) * G.Hq + at.head) * G.T + at.pos) * int64_t(G.Dv) + c0;
  if (inv_sum == 0.0f) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int j = 0; j < n; ++j) {
      o[j] = S::store(nan);
    }
  } else {
    for (int j = 0; j < n; ++j) {
      o[j] = S::store(acc[j] * inv_sum);
    }
  }
}

} // namespace mtplx::cpu
