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
  return {g * G.n_rep + i % G.n_rep, i / G.n_rep};
}

// The visible key span [first, last) of every row of a job. `blind` rows
// see no key.
struct Spans {
  std::vector<int> first, last;
  std::vector<char> blind;
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
  for (int i = 0; i < rows; ++i) {
    const RowAt at = row_at(G, g, i);
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
      } else {
        sp.blind[i] = 1;
      }
    }
  }
  sp.lo = *std::min_element(sp.first.begin(), sp.first.end());
  sp.hi = *std::max_element(sp.last.begin(), sp.last.end());
}

// Masks and exponentiates row i's scores sr[lo, hi) in place (keys in
// [lo8, lo) and [hi, hi8) get weight 0), where lo8 / hi8 round lo / hi to
// whole lanes. Returns 1 / (sum of the weights), or 0 for a row to be
// written as NaN (its maximum is not finite or it holds a NaN; its weights
// are then zeroed so the weighted sum stays finite).
template <class S>
MTPLX_FUSED_INLINE float softmax_row(
    float* sr,
    const MaskView& mask,
    AttentionMask kind,
    const Spans& sp,
    int i,
    int b,
    RowAt at,
    int lo,
    int hi) {
  using bits_t = typename S::bits_t;
  constexpr float lowest = lowest_of<S>();
  const int lo8 = lo / kLanes * kLanes, hi8 = round_up_lanes(hi);
  const int first = sp.first[i], last = sp.last[i];
  if (kind == AttentionMask::kCausal) {
    const int from = sp.blind[i] ? lo : std::max(last, lo);
    for (int s = from; s < hi; ++s) {
      sr[s] = lowest;
    }
  } else if (kind == AttentionMask::kArray) {
    const int64_t off = mask.offset(b, at.head, at.pos);
    const int64_t st = mask.st[3];
    if (mask.is_bool) {
      const bool* m = static_cast<const bool*>(mask.data) + off;
      for (int s = lo; s < hi; ++s) {
        sr[s] = (s >= first && s < last && m[s * st]) ? sr[s] : lowest;
      }
    } else {
      const bits_t* m = static_cast<const bits_t*>(mask.data) + off;
      for (int s = lo; s < hi; ++s) {
        sr[s] += S::load(m[s * st]);
      }
    }
  }
  for (int s = lo8; s < lo; ++s) {
    sr[s] = kNegInf;
  }
  for (int s = hi; s < hi8; ++s) {
    sr[s] = kNegInf;
  }
  vf8 mv = vf8{} + kNegInf;
  vi8 nan = vi8{};
  for (int s = lo8; s < hi8; s += kLanes) {
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
  if (has_nan || !std::isfinite(m)) {
    std::fill(sr + lo8, sr + hi8, 0.0f);
    return 0.0f;
  }
  vf8 sum = vf8{};
  for (int s = lo8; s < hi8; s += kLanes) {
    const vf8 e = exp_nonpos8(load8(sr + s) - m);
    store8(sr + s, e);
    sum += e;
  }
  return 1.0f / hsum8(sum);
}

// Writes output row `at` of batch b: acc[0, Dv) * inv_sum, or NaN where
// inv_sum is 0 (see softmax_row).
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
