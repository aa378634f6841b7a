// The quantized packed GEMM on AMX (compiled with -mamx-tile -mamx-int8 and
// AVX-512 VNNI): a call of many rows (a batch's verification, a prefill)
// takes each group's integer sums from the tile unit, one tdpbsud per 16
// columns and 64 inputs for up to 16 rows at once; a call of few rows (a
// plain step, a verification of one stream) runs the AVX-512 VNNI tiles. The integer sums are exact either
// way and every group is folded by the VNNI kernel's own fold, so the bits
// are the other kernels' (qgemm.h).
//
// Why: with vpdpbusd a call spends 1-2 instructions per row and 64 weight
// bytes; the tile unit does a 16 x 16 x 64 product per instruction. The weight's B tiles are the packed blocks themselves in the
// byte container (a block row is 16 columns x 4 inputs: the tile's layout,
// at a stride of 4 blocks), and the nibble container's halves unpacked into
// an L1 buffer.
#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu/qgemm_avx512_traits.h"

namespace mtplx::cpu::qgemm_detail {
namespace {

// Rows per tile: the tile unit's maximum.
constexpr int kAmxRows = 16;

// The tile configuration (LDTILECFG's 64-byte operand, palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: C 0-3 (R rows x 16 int32, one per block of 16 columns), A 4 (R
// rows x up to 64 activation bytes), B 5-7 (up to 16 rows of 4 inputs x
// 16 columns).
void configure(int R, int kchunk) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = uint8_t(R);
    cfg.colsb[t] = 64;
  }
  cfg.rows[4] = uint8_t(R);
  cfg.colsb[4] = uint16_t(kchunk);
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = uint8_t(kchunk / 4);
    cfg.colsb[t] = 64;
  }
  // The stores above must reach memory before ldtilecfg reads it (GCC does
  // not see the instruction read its operand).
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Releases the tile state when a call ends (a thread that keeps it makes
// every context switch save and restore 8 KiB).
struct TileScope {
  ~TileScope() { _tile_release(); }
};

// Group g's block of the nibble container as B tiles: block j's 16 columns
// x gs inputs at buf + j * gs * 16 (row 2 s: step s's low nibbles, inputs
// 8 s .. 8 s + 3; row 2 s + 1: its high ones).
inline void unpack_nibbles(const uint8_t* w, int steps, uint8_t* buf) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int s = 0; s < steps; ++s) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(w + s * 256 + j * 64);
      uint8_t* row = buf + j * (steps * 2 * 64) + s * 128;
      _mm512_store_si512(row, _mm512_and_si512(v, mask));
      _mm512_store_si512(
          row + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
  }
}

// A group whose C tiles still wait for their fold.
template <ScaleType S>
struct Pending {
  int g;
  int64_t i0;
  int R;
  const typename ScaleBits<S>::type* sb;
  float* dst;
  int64_t ld;
};

// Folds blocks j0, j0 + 1 of a pending group from cbuf.
template <ScaleType S>
inline void fold_half(
    const Call& c,
    const Pending<S>& q,
    int32_t (*cbuf)[kAmxRows * 16],
    int j0) {
  using T = Avx512Vnni;
  typename T::F scale[2], bias[2];
  for (int j = 0; j < 2; ++j) {
    scale[j] = T::template scales<S>(q.sb + (j0 + j) * 16);
    bias[j] = T::template scales<S>(q.sb + kQPanel + (j0 + j) * 16);
  }
  for (int i = 0; i < q.R; ++i) {
    const RowGroup& rg = c.rg[(q.i0 + i) * c.G + q.g];
    float* out = q.dst + (q.i0 + i) * q.ld + j0 * 16;
    for (int j = 0; j < 2; ++j) {
      T::fold(
          out + j * 16, _mm512_load_si512(cbuf[j0 + j] + i * 16), scale[j],
          bias[j], rg);
    }
  }
}

template <bool Nib, ScaleType S>
void panels_tiles(const Call& c, int p0, int p1) {
  using SB = typename ScaleBits<S>::type;
  constexpr int kStepK = Nib ? 8 : 4;
  const int gs = c.group_size;
  const int steps = gs / kStepK;
  const int kchunk = gs < 64 ? gs : 64;
  const int64_t block = int64_t(steps) * 4 * 64;
  const auto* sb = static_cast<const SB*>(c.sb);
  alignas(64) uint8_t bbuf[4 * 128 * 16];  // 4 blocks x up to 128 inputs
  alignas(64) int32_t cbuf[4][kAmxRows * 16];
  alignas(64) float scratch[64 * kQPanel];
  TileScope scope;
  int configured = 0;
  Pending<S> pending{-1, 0, 0, nullptr, nullptr, 0};
  for (int p = p0; p < p1; ++p) {
    const PanelOut out(c, p, scratch);
    // Row tiles of 16 (the last one shorter), each over the whole panel:
    // the panel's weight (K x 64 values) stays in L2 for the next tile.
    for (int64_t i0 = 0; i0 < c.M; i0 += kAmxRows) {
      const int R = int(c.M - i0 < kAmxRows ? c.M - i0 : kAmxRows);
      if (R != configured) {
        configure(R, kchunk);
        configured = R;
      }
      for (int g = 0; g < c.G; ++g) {
        const int64_t at = int64_t(p) * c.G + g;
        const uint8_t* w = c.wq + at * block;
        const SB* sbg = sb + at * 2 * kQPanel;
        if (i0 == 0) {  // the stream ahead, as the VNNI tiles prefetch it
          for (int64_t b = 0; b < block; b += 64) {
            __builtin_prefetch(w + kPrefetchAhead + b, 0, 3);
          }
          prefetch_scales_ahead(sbg, block);
        }
        const int8_t* a = c.xq + i0 * c.K + int64_t(g) * gs;
        const uint8_t* b[4];
        int64_t ldb;
        if constexpr (Nib) {
          unpack_nibbles(w, steps, bbuf);
          for (int j = 0; j < 4; ++j) {
            b[j] = bbuf + j * int64_t(gs) * 16;
          }
          ldb = 64;
        } else {
          for (int j = 0; j < 4; ++j) {
            b[j] = w + j * 64;
          }
          ldb = 256;
        }
        // Blocks 0-1 into C 0-1 while the previous group's blocks 2-3 are
        // stored and folded; then blocks 2-3 into C 2-3 while these are
        // (tiles are not renamed: one set's products overlap only the other
        // set's stores and fold). Written out twice: GCC's tile intrinsics
        // paste their tile numbers into the assembly text, so they cannot
        // be template parameters.
        _tile_zero(0);
        _tile_zero(1);
        for (int k = 0; k < gs; k += 64) {
          _tile_loadd(4, a + k, c.K);
          _tile_loadd(5, b[0] + (k / 4) * ldb, ldb);
          _tile_dpbsud(0, 4, 5);
          _tile_loadd(6, b[1] + (k / 4) * ldb, ldb);
          _tile_dpbsud(1, 4, 6);
        }
        if (pending.g >= 0) {
          _tile_stored(2, cbuf[2], 64);
          _tile_stored(3, cbuf[3], 64);
          fold_half<S>(c, pending, cbuf, 2);
        }
        _tile_zero(2);
        _tile_zero(3);
        for (int k = 0; k < gs; k += 64) {
          _tile_loadd(4, a + k, c.K);
          _tile_loadd(7, b[2] + (k / 4) * ldb, ldb);
          _tile_dpbsud(2, 4, 7);
          _tile_loadd(5, b[3] + (k / 4) * ldb, ldb);
          _tile_dpbsud(3, 4, 5);
        }
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
        pending = Pending<S>{g, i0, R, sbg, out.dst, out.ld};
        fold_half<S>(c, pending, cbuf, 0);
      }
      if (pending.g >= 0) {
        _tile_stored(2, cbuf[2], 64);
        _tile_stored(3, cbuf[3], 64);
        fold_half<S>(c, pending, cbuf, 2);
        pending.g = -1;
      }
    }
    out.finish();
  }
}

} // namespace

// Rows from which the tiles beat the VNNI kernel: below, a group's tile
// products, stores and reloads wait on one another longer than a few rows
// of vpdpbusd take (measured on an Intel Xeon, Emerald Rapids: at 4 rows
// the tiles ran 0.83x the VNNI kernel at 4 bits, 0.90x at 8; at 16 rows
// 1.31x and 1.07x; at 40, 1.48x and 1.18x). The nibble container gains
// sooner: its VNNI kernel spends 2 vpdpbusd per row and 64 bytes.
template <bool Nib>
constexpr int kTileRows = Nib ? 8 : 16;

template <bool Nib, ScaleType S>
void panels_amx(const Call& c, int p0, int p1) {
  if (c.M < kTileRows<Nib>) {
    panels<Avx512Vnni, Nib, S>(c, p0, p1);
  } else {
    panels_tiles<Nib, S>(c, p0, p1);
  }
}
template void panels_amx<true, ScaleType::f32>(const Call&, int, int);
template void panels_amx<true, ScaleType::f16>(const Call&, int, int);
template void panels_amx<true, ScaleType::bf16>(const Call&, int, int);
template void panels_amx<false, ScaleType::f32>(const Call&, int, int);
template void panels_amx<false, ScaleType::f16>(const Call&, int, int);
template void panels_amx<false, ScaleType::bf16>(const Call&, int, int);

bool amx_ready() {
  static const bool ready = [] {
  // CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25); then the
  // kernel's permission for this process to use the tile data state
  // (Linux: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18).
  unsigned a = 0, b = 0, cx = 0, d = 0;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(cx), "=d"(d) : "a"(7), "c"(0));
  if (!(d & (1u << 24)) || !(d & (1u << 25))) {
    return false;
  }
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
  return false;
#endif
  }();
  return ready;
}

} // namespace mtplx::cpu::qgemm_detail
#endif
