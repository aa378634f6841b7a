// y = x W^T for x [M, K] and W [N, K] stored with MLX's affine quantization
// (w = scale * q + bias per group of `group_size` input indices, q unsigned
// of `bits` bits), repacked once at load for the CPU decode GEMM.
//
// Packed layout. Output columns go in panels of kQPanel = 64 (the last one
// zero padded: q, scale and bias 0), a panel in blocks of 16 columns. Each
// weight stream is [P, G, steps, 4 blocks, 64 bytes] uint8, G = K /
// group_size: the 64 bytes of a block hold, for its 16 columns l, 4 bytes at
// 4 l. In the byte container (bits 5-8) they are q at k = 4 s + t (t < 4) of
// the group; in the nibble container (bits 2-4) byte 4 l + t holds q at
// k = 8 s + t in its low nibble and at k = 8 s + 4 + t in its high one.
// steps = group_size / 4 (bytes) or group_size / 8 (nibbles). Scales and
// biases are [P, G, 2, 64] in the checkpoint's dtype (float32, float16 or
// bfloat16), read as they are stored.
//
// Why this layout: a block of 64 bytes is one AVX-512 vector whose 32-bit
// lanes are the 16 columns, so one VNNI instruction (vpdpbusd, unsigned q
// bytes x signed activation bytes) adds 4 products to each column's integer
// sum, for each row of the tile from one broadcast of 4 activation bytes.
// The weight streams once per call; a group's block (2-8 KiB) stays in L1
// while every row tile of the call reads it.
//
// Activations are quantized per row and group to int8 (symmetric: d =
// max|x| / 127, xq = round(x / d)), as llama.cpp does for its integer dot
// products. With c = 2^(bits - 1) the middle of q's range, per row i, group
// g and column n (sums over the group's k):
//   sum_k w x = s sum_k q x + b sum_k x
//             ~ s (d sum_k (q - c) xq + c sum_k x) + b sum_k x,
// computed as y = 0, then for g = 0 .. G-1:
//   t = fma(float(I - c sum_k xq), d, c xs);  y = fma(s, t, y);
//   y = fma(b, xs, y)
// with I = sum_k q xq the group's exact integer dot product and xs the float
// sum of the unquantized activations. Centring q keeps the rounding of x
// away from the large constant part of w (b + c s, folded in exactly). The
// integer
// sums are exact and the float steps run in one fixed order per output, so a
// row's result depends neither on the other rows of the call, nor on the
// thread split, nor on the instruction set (every kernel gives the same
// bits). The only approximation against the dequantized product is the
// activations' rounding: |error| <= sum_g |s| d / 2 sum_k |q - c|, plus the
// float rounding of the fold.
#pragma once

#include <cstdint>
#include <string>

namespace mtplx {

// Output columns per panel of the quantized packed GEMM.
constexpr int kQPanel = 64;

namespace cpu {

enum class ScaleType : int { f32 = 0, f16 = 1, bf16 = 2 };

// Whether `bits` is stored in nibbles (2, 3, 4) or bytes (5, 6, 8).
inline bool q_nibbles(int bits) {
  return bits <= 4;
}

// Input indices per 64-byte block (one step of a group).
inline int q_step_k(int bits) {
  return q_nibbles(bits) ? 8 : 4;
}

// y [M, N] float32 (row stride N) = x [M, K] float32 @ W^T, W packed as
// above. Splits the panels over up to `threads` threads when the weight is
// large enough to pay. Requires K = G * group_size, group_size a multiple of
// 16 (the activations' quantization runs over 16 lanes) with group_size *
// 255 * 127 < 2^24 (the integer sums convert to float exactly), M >= 0 (the
// op checks them: group sizes 32, 64 and 128).
void qgemm(
    const float* x,
    int64_t M,
    int K,
    const uint8_t* wq,
    const void* sb,
    ScaleType st,
    int N,
    int group_size,
    int bits,
    float* y,
    int threads);

// Hands the thread pool's idle worker (prefetch_in_background) the packed
// weight wq [P, G, block] / sb of the product that comes next, to stream
// toward the caches while the ops between the two products run: first the
// panels the worker itself will multiply (the second long run of
// parallel_panels, which it claims first) with their scales, then the
// first panels, 2 MiB in all. Needs no result of anything; changes none.
void qgemm_prefetch_next(
    const uint8_t* wq,
    int P,
    int64_t wq_bytes,
    const void* sb,
    int64_t sb_bytes,
    int threads);

// "amx" (AMX-INT8 tiles for calls of many rows, AVX-512 VNNI for few:
// qgemm_amx.cpp), "avx512" (AVX-512 VNNI), "avx2", "generic": the kernel this CPU
// runs.
const char* qgemm_isa();

// Runs the kernels of `name` from now on in this process ("" returns to the
// CPU's pick); returns the previous override. Throws std::invalid_argument
// naming `isa` for a name this CPU cannot run.
std::string set_qgemm_isa(const std::string& name);

namespace qgemm_detail {

// A row's group of quantized activations: d, xs = sum x, cxs = c xs (exact:
// c is a power of two) and cq = c sum xq.
struct RowGroup {
  float d, xs, cxs;
  int32_t cq;
};

// One call's operands for a kernel: rows [0, M) of the quantized
// activations (xq [M, K] row-major, rg [M, G]).
struct Call {
  const int8_t* xq;
  const RowGroup* rg;
  int64_t M;
  int K;
  int G;
  int group_size;
  const uint8_t* wq;
  const void* sb;
  int N;
  float* y;
};

using PanelsFn = void (*)(const Call&, int, int);

// One row's activations quantized per group (see quantize_row in
// qgemm.cpp for the contract every instruction set meets bit for bit).
using QuantizeFn = void (*)(const float*, int, int, int, int8_t*, RowGroup*);
void quantize_row_generic(const float*, int, int, int, int8_t*, RowGroup*);
void quantize_row_avx512(const float*, int, int, int, int8_t*, RowGroup*);
void quantize_row_avx2(const float*, int, int, int, int8_t*, RowGroup*);

// Lanes of the activations' quantization, and its rounding constant.
constexpr int kQuantLanes = 16;
constexpr float kRoundMagic = 12582912.0f; // 1.5 * 2^23

// A group's RowGroup from its lane-reduced max |x|, sum and integer sum.
inline void finish_group(
    float amax,
    float sum,
    bool finite,
    int32_t qsum,
    int bits,
    RowGroup& rg) {
  const int c = 1 << (bits - 1);
  rg.d = finite ? amax / 127.0f : __builtin_nanf("");
  rg.xs = sum;
  rg.cxs = float(c) * sum;
  rg.cq = c * qsum;
}

// Max |x|, sum and finiteness of a group from its lanes' partial values
// (kQuantLanes each; overwritten): folded pairwise, lane l += lane l + 8,
// + 4, + 2, + 1, the order every kernel keeps.
struct LaneTotals {
  float amax, sum;
  bool finite;
};
inline LaneTotals fold_lanes(float* amax, float* sum, float* nonfinite) {
  for (int w = kQuantLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) {
      amax[l] = amax[l] < amax[l + w] ? amax[l + w] : amax[l];
      sum[l] += sum[l + w];
      nonfinite[l] += nonfinite[l + w];
    }
  }
  return {amax[0], sum[0], nonfinite[0] == 0.0f};
}

// The scale that maps a group onto [-127, 127] (0 for an all-zero or
// non-finite group).
inline float group_inverse(float amax, bool finite) {
  return amax > 0.0f && finite ? 127.0f / amax : 0.0f;
}

// Panels [p0, p1) for every row; one per (instruction set, container,
// scale type).
template <bool Nibbles, ScaleType S>
void panels_avx512(const Call& c, int p0, int p1);
template <bool Nibbles, ScaleType S>
void panels_avx2(const Call& c, int p0, int p1);
template <bool Nibbles, ScaleType S>
void panels_amx(const Call& c, int p0, int p1);

// Whether this CPU has AMX-INT8 and the OS lets this process use it (asks
// once for the permission, on Linux).
bool amx_ready();
template <bool Nibbles, ScaleType S>
void panels_generic(const Call& c, int p0, int p1);

// Rows per full tile (16 integer accumulators: 4 rows x 4 blocks).
constexpr int kRows = 4;

} // namespace qgemm_detail
} // namespace cpu
} // namespace mtplx
