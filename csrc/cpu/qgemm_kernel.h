// The quantized packed GEMM's loops (see qgemm.h) over an instruction-set
// traits type T:
//   Acc (16 int32 lanes), W (64 bytes), F (16 float lanes);
//   zero(), load_w(p), lo(w) / hi(w) (a nibble block's two halves);
//   dot<Small>(acc, w, x4): acc[l] += sum_t w[4 l + t] * x4[t] (unsigned
//     bytes x signed bytes, exact; Small: every w < 16);
//   scales<S>(p): 16 stored scales as floats;
//   fold(y, acc, s, b, rg): t = fma(float(acc - rg.cq), rg.d, rg.cxs);
//     y = fma(b, rg.xs, fma(s, t, y)) (qgemm.h).
// Included by one file per instruction set, compiled with that set enabled.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/packed_gemm.h"
#include "cpu/qgemm.h"

namespace mtplx::cpu::qgemm_detail {


// Bytes ahead of its reads at which a row tile's weight stream is
// prefetched (the lead tile of each group only: the others read the same
// block). One core's hardware prefetchers alone left the stream at about
// four fifths of the read rate on an Intel Xeon (Emerald Rapids); 4-16 KiB
// ahead measured alike, 8 KiB the best (bench/RESULTS.md).
constexpr int64_t kPrefetchAhead = 8192;

template <ScaleType S>
struct ScaleBits {
  using type = uint16_t;
};
template <>
struct ScaleBits<ScaleType::f32> {
  using type = float;
};

// Prefetches the scales and biases (2 x 64 per group at sb) of the group
// as far ahead in their stream as kPrefetchAhead is in the weight's, whose
// groups are `block` bytes.
template <class SB>
inline void prefetch_scales_ahead(const SB* sb, int64_t block) {
  const int64_t ahead = kPrefetchAhead / block + 1;
  const char* p = reinterpret_cast<const char*>(sb + ahead * 2 * kQPanel);
  for (int b = 0; b < int(sizeof(SB)) * 2 * kQPanel; b += 64) {
    __builtin_prefetch(p + b, 0, 3);
  }
}

// One panel's output: its 64 columns of y in place, or for the partial last
// panel a scratch tile that finish() copies out; zeroed first (the fold
// adds into it).
class PanelOut {
 public:
  PanelOut(const Call& c, int p, float* scratch)
      : c_(c),
        n0_(p * kQPanel),
        full_(n0_ + kQPanel <= c.N),
        dst(full_ ? c.y + n0_ : scratch),
        ld(full_ ? c.N : kQPanel) {
    for (int64_t i = 0; i < c.M; ++i) {
      std::memset(dst + i * ld, 0, sizeof(float) * kQPanel);
    }
  }

  void finish() const {
    if (!full_) {
      for (int64_t i = 0; i < c_.M; ++i) {
        std::memcpy(
            c_.y + i * c_.N + n0_, dst + i * kQPanel,
            sizeof(float) * (c_.N - n0_));
      }
    }
  }

 private:
  const Call& c_;
  const int n0_;
  const bool full_;

 public:
  float* const dst;
  const int64_t ld;
};

inline int32_t x4_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows [i0, i0 + R) x the panel's 4 blocks over group g: the integer sums
// of the group, folded into out (R rows of stride ldo, 64 columns).
template <class T, bool Nib, ScaleType S, int R>
inline void tile(
    const Call& c,
    int64_t i0,
    const uint8_t* w,
    const typename ScaleBits<S>::type* sb,
    int g,
    float* out,
    int64_t ldo,
    bool lead) {
  using Acc = typename T::Acc;
  constexpr int kStepK = Nib ? 8 : 4;
  const int steps = c.group_size / kStepK;
  Acc acc[R][4];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      acc[i][j] = T::zero();
    }
  }
  const int8_t* x = c.xq + i0 * c.K + int64_t(g) * c.group_size;
  if (lead) {
    prefetch_scales_ahead(sb, int64_t(steps) * 4 * 64);
  }
  for (int s = 0; s < steps; ++s) {
    if (lead) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __builtin_prefetch(w + kPrefetchAhead + j * 64, 0, 3);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const auto wv = T::load_w(w + j * 64);
      if constexpr (Nib) {
        const auto lo = T::lo(wv), hi = T::hi(wv);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          acc[i][j] = T::template dot<true>(acc[i][j], lo, x4_at(x + i * c.K));
          acc[i][j] =
              T::template dot<true>(acc[i][j], hi, x4_at(x + i * c.K + 4));
        }
      } else {
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          acc[i][j] = T::template dot<false>(acc[i][j], wv, x4_at(x + i * c.K));
        }
      }
    }
    x += kStepK;
    w += 4 * 64;
  }
  typename T::F scale[4], bias[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    scale[j] = T::template scales<S>(sb + j * 16);
    bias[j] = T::template scales<S>(sb + kQPanel + j * 16);
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    const RowGroup& rg = c.rg[(i0 + i) * c.G + g];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      T::fold(out + i * ldo + j * 16, acc[i][j], scale[j], bias[j], rg);
    }
  }
}

template <class T, bool Nib, ScaleType S, int R = kRows>
inline void tile_of(
    int r,
    const Call& c,
    int64_t i0,
    const uint8_t* w,
    const typename ScaleBits<S>::type* sb,
    int g,
    float* out,
    int64_t ldo,
    bool lead) {
  if constexpr (R >= 1) {
    if (r == R) {
      tile<T, Nib, S, R>(c, i0, w, sb, g, out, ldo, lead);
    } else {
      tile_of<T, Nib, S, R - 1>(r, c, i0, w, sb, g, out, ldo, lead);
    }
  }
}

// Panels [p0, p1) for every row (M <= 64): panel by panel, group by group,
// each group's block against every row tile. The partial last panel is
// computed into a scratch tile. The weight is one sequential stream per
// thread, prefetched kPrefetchAhead bytes ahead, and its scales as many
// groups ahead.
template <class T, bool Nib, ScaleType S>
inline void panels(const Call& c, int p0, int p1) {
  using SB = typename ScaleBits<S>::type;
  const packed_detail::RowTiles rt(c.M, kRows);
  if (rt.count == 0) {
    return;
  }
  const int64_t block = int64_t(c.group_size) / (Nib ? 8 : 4) * 4 * 64;
  const auto* wq = c.wq;
  const auto* sb = static_cast<const SB*>(c.sb);
  alignas(64) float scratch[64 * kQPanel];
  for (int p = p0; p < p1; ++p) {
    const PanelOut out(c, p, scratch);
    for (int g = 0; g < c.G; ++g) {
      const int64_t at = int64_t(p) * c.G + g;
      const uint8_t* w = wq + at * block;
      for (int64_t t = 0; t < rt.count; ++t) {
        const int64_t i0 = rt.start(t);
        tile_of<T, Nib, S>(
            int(rt.size(t)), c, i0, w, sb + at * 2 * kQPanel, g,
            out.dst + i0 * out.ld, out.ld, t == 0);
      }
    }
    out.finish();
  }
}

// The six instantiations of one instruction set's panels.
#define MTPLX_QGEMM_INSTANTIATE(fn, T)                                   \
  template <bool Nib, ScaleType S>                                      \
  void fn(const Call& c, int p0, int p1) {                              \
    panels<T, Nib, S>(c, p0, p1);                                       \
  }                                                                     \
  template void fn<true, ScaleType::f32>(const Call&, int, int);        \
  template void fn<true, ScaleType::f16>(const Call&, int, int);        \
  template void fn<true, ScaleType::bf16>(const Call&, int, int);       \
  template void fn<false, ScaleType::f32>(const Call&, int, int);       \
  template void fn<false, ScaleType::f16>(const Call&, int, int);       \
  template void fn<false, ScaleType::bf16>(const Call&, int, int);

} // namespace mtplx::cpu::qgemm_detail
