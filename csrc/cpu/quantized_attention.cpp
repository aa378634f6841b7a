// eval_cpu of FusedQuantizedAttention: attention over keys and values held
// in MLX's affine quantized layout (mx.quantize along the head dimension, as
// mlx-lm's QuantizedKVCache stores them), read directly: no dequantized copy
// of the cache is made.
//
// The shared segment kernel (cpu/attention_kernel.h): each unit (batch, kv
// head, segment of keys) dequantizes its key and value rows once (w = scale *
// q + bias, float32) into small per-thread buffers and runs them for every
// query row of its kv head. So each quantized KV byte is read once per call,
// whatever the number of query rows (the K + 1 positions of a verification
// and the query heads of a GQA group), and a row's result does not depend on
// the other rows of the call: a verification of K + 1 positions gives each
// position what a one-token step gives it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/attention_kernel.h"
#include "fused_primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mtplx {

namespace {

using namespace cpu;


// A packed [B, Hkv, S, words] uint32 array with its scales and biases
// [B, Hkv, S, groups] (any float dtype, any strides).
struct Packed {
  const uint32_t* w;
  int64_t ws[4];
  const void* s;
  int64_t ss[4];
  const void* b;
  int64_t bs[4];
  mx::Dtype sdtype = mx::float32;
  int width; // dequantized row length (D or Dv)
};

// The 8 values of bits [8 * BITS * i, 8 * BITS * (i + 1)) of a row's
// LSB-first bit stream (BITS 4 or 8), as floats.
// The 8 values of bits [8 * BITS * i, 8 * BITS * (i + 1)) of a row's
// LSB-first bit stream (BITS 4 or 8), as floats.
template <int BITS>
MTPLX_FUSED_INLINE vf8 unpack8(const uint8_t* bytes) {
  if constexpr (BITS == 8) {
    uint32_t w[2];
    std::memcpy(w, bytes, 8);
    const vi8 first = vi8{-1, -1, -1, -1, 0, 0, 0, 0};
    const vi8 x = ((((vi8{} + int32_t(w[0])) & first) |
                    ((vi8{} + int32_t(w[1])) & ~first)) >>
                   vi8{0, 8, 16, 24, 0, 8, 16, 24}) &
        255;
    return __builtin_convertvector(x, vf8);
  } else {
    uint32_t w;
    std::memcpy(&w, bytes, 4);
    const vi8 x =
        ((vi8{} + int32_t(w)) >> vi8{0, 4, 8, 12, 16, 20, 24, 28}) & 15;
    return __builtin_convertvector(x, vf8);
  }
}

// Rows [a, e) of job (b, g) of `pk` dequantized (scale * q + bias, float32)
// into dst, rows `padded` floats apart (zero padded). SS: the scales'
// storage type; BITS 8 or 4 (whole bytes per 8 or 4 values, vectorized) or
// 0 for any width (a field may straddle two bytes).
template <class SS, int BITS>
MTPLX_FUSED_INLINE void dequant_rows(
    const Packed& pk,
    const SegmentAt& at,
    int bits,
    int group_size,
    int padded,
    float* dst) {
  const int b = at.b, g = at.g;
  using sbits_t = typename SS::bits_t;
  const int words = pk.width * bits / 32;
  const int nbytes = words * 4;
  const int groups = pk.width / group_size;
  thread_local std::vector<uint32_t> local;
  local.resize(words);
  const sbits_t* sp = static_cast<const sbits_t*>(pk.s) + b * pk.ss[0] + g * pk.ss[1];
  const sbits_t* bp = static_cast<const sbits_t*>(pk.b) + b * pk.bs[0] + g * pk.bs[1];
  for (int s = at.a; s < at.e; ++s, dst += padded) {
    const uint32_t* w = pk.w + b * pk.ws[0] + g * pk.ws[1] + s * pk.ws[2];
    if (pk.ws[3] != 1) {
      for (int j = 0; j < words; ++j) {
        local[j] = w[j * pk.ws[3]];
      }
      w = local.data();
    }
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w);
    for (int gi = 0; gi < groups; ++gi) {
      const float sc = SS::load(sp[s * pk.ss[2] + gi * pk.ss[3]]);
      const float bi = SS::load(bp[s * pk.bs[2] + gi * pk.bs[3]]);
      const int g0 = gi * group_size, end = g0 + group_size;
      if constexpr (BITS != 0) {
        const vf8 vs = vf8{} + sc, vb = vf8{} + bi;
        for (int d = g0; d < end; d += kLanes) {
          store8(dst + d, unpack8<BITS>(bytes + d * BITS / 8) * vs + vb);
        }
      } else {
        const uint32_t mask = (1u << bits) - 1;
        for (int d = g0; d < end; ++d) {
          const int bit = d * bits, at = bit >> 3;
          uint32_t two = bytes[at];
          if (at + 1 < nbytes) {
            two |= uint32_t(bytes[at + 1]) << 8;
          }
          dst[d] = sc * float((two >> (bit & 7)) & mask) + bi;
        }
      }
    }
    std::fill(dst + pk.width, dst + padded, 0.0f);
  }
}

// The segment's rows of `pk` dequantized into dst, rows `padded` apart.
MTPLX_FUSED_INLINE void dequant_segment(
    const Packed& pk,
    const SegmentAt& at,
    int bits,
    int group_size,
    int padded,
    float* dst) {
  with_float_dtype(pk.sdtype, [&]<class SS>() __attribute__((always_inline)) {
    if (bits == 8) {
      dequant_rows<SS, 8>(pk, at, bits, group_size, padded, dst);
    } else if (bits == 4) {
      dequant_rows<SS, 4>(pk, at, bits, group_size, padded, dst);
    } else {
      dequant_rows<SS, 0>(pk, at, bits, group_size, padded, dst);
    }
  });
}

// Keys and values quantized: rows are dequantized per segment into the
// unit's buffers.
struct QuantSource {
  Packed k, v;
  int bits, group_size;
  int Dp, Dvp;

  MTPLX_FUSED_INLINE KVRows rows(const SegmentAt& at, UnitScratch& sc) const {
    const int n = at.e - at.a;
    sc.kbuf.resize(size_t(n) * Dp);
    sc.vbuf.resize(size_t(n) * Dvp);
    dequant_segment(k, at, bits, group_size, Dp, sc.kbuf.data());
    dequant_segment(v, at, bits, group_size, Dvp, sc.vbuf.data());
    return {sc.kbuf.data(), Dp, sc.vbuf.data(), Dvp};
  }
};

MTPLX_ATTENTION_CLONES void qunit_cpu(
    mx::Dtype dtype,
    const Geometry& G,
    AttentionPlan& plan,
    const QuantSource& src,
    const MaskView& mask,
    AttentionMask kind,
    int u) {
  with_float_dtype(dtype, [&]<class S>() __attribute__((always_inline)) {
    run_unit<S>(G, plan, src, mask, kind, u);
  });
}

Packed packed_of(
    const mx::array& w,
    const mx::array& s,
    const mx::array& b,
    int group_size) {
  Packed p;
  p.w = w.data<uint32_t>();
  p.s = s.data<void>();
  p.b = b.data<void>();
  p.sdtype = s.dtype();
  for (int i = 0; i < 4; ++i) {
    p.ws[i] = w.strides()[i];
    p.ss[i] = s.strides()[i];
    p.bs[i] = b.strides()[i];
  }
  p.width = s.shape(3) * group_size;
  return p;
}

void qattention_cpu(
    std::vector<mx::array>& in,
    mx::array& out,
    AttentionMask kind,
    float scale,
    int bits,
    int gs) {
  const mx::array& q = in[0];
  const Geometry G =
      geometry_of(q, in[1].shape(1), in[1].shape(2), in[5].shape(3) * gs);
  if (out.size() == 0) {
    return;
  }
  QueryView qv;
  qv.q = q.data<void>();
  for (int i = 0; i < 4; ++i) {
    qv.qs[i] = q.strides()[i];
  }
  QuantSource src;
  src.k = packed_of(in[1], in[2], in[3], gs);
  src.v = packed_of(in[4], in[5], in[6], gs);
  src.bits = bits;
  src.group_size = gs;
  src.Dp = G.Dp;
  src.Dvp = G.Dvp;
  const MaskView mv(in.size() > 7 ? &in[7] : nullptr);
  const mx::Dtype dtype = q.dtype();
  void* o = out.data<void>();
  run_attention(
      dtype,
      G,
      qv,
      mv,
      kind,
      scale,
      [&](const Geometry& Gc, AttentionPlan& plan, int u) {
        qunit_cpu(dtype, Gc, plan, src, mv, kind, u);
      },
      [&](const Geometry& Gc, AttentionPlan& plan, int j) {
        merge_cpu(dtype, Gc, plan, o, j);
      });
}

} // namespace

void FusedQuantizedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [kind = mask_, scale = scale_, bits = bits_, gs = group_size_](
                 std::vector<mx::array>& in, mx::array& out) {
    qattention_cpu(in, out, kind, scale, bits, gs);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
