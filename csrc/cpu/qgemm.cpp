// The quantized packed GEMM's driver (see qgemm.h): quantizes the
// activations row by row, picks the instruction set once, and splits the
// panels over threads.
#include "cpu/qgemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/kernel_choice.h"
#include "cpu/thread_pool.h"

namespace mtplx::cpu {

namespace {

using qgemm_detail::Call;
using qgemm_detail::PanelsFn;

// One variant's kernels for every (container, scale type), and its
// activation quantization.
struct QKernels {
  PanelsFn fn[2][3];  // [nibbles][scale type]
  qgemm_detail::QuantizeFn quantize;
};

#define MTPLX_QKERNELS(fn, quantize)                                    \
  QKernels {                                                            \
    {{qgemm_detail::fn<false, ScaleType::f32>,                          \
      qgemm_detail::fn<false, ScaleType::f16>,                          \
      qgemm_detail::fn<false, ScaleType::bf16>},                        \
     {qgemm_detail::fn<true, ScaleType::f32>,                           \
      qgemm_detail::fn<true, ScaleType::f16>,                           \
      qgemm_detail::fn<true, ScaleType::bf16>}},                        \
    qgemm_detail::quantize                                              \
  }

const QKernels kGeneric =
    MTPLX_QKERNELS(panels_generic, quantize_row_generic);
#if defined(__x86_64__) && defined(__GNUC__)
const QKernels kAvx512 = MTPLX_QKERNELS(panels_avx512, quantize_row_avx512);
const QKernels kAvx2 = MTPLX_QKERNELS(panels_avx2, quantize_row_avx2);
const QKernels kAmx = MTPLX_QKERNELS(panels_amx, quantize_row_avx512);
bool runs_avx512_vnni() {
  return __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni");
}
bool runs_amx() {
  return runs_avx512_vnni() && qgemm_detail::amx_ready();
}
bool runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
}
const KernelVariant<const QKernels*> kVariants[] = {
    {&kAmx, "amx", runs_amx},
    {&kAvx512, "avx512", runs_avx512_vnni},
    {&kAvx2, "avx2", runs_avx2},
    {&kGeneric, "generic", runs_everywhere}};
#else
const KernelVariant<const QKernels*> kVariants[] = {
    {&kGeneric, "generic", runs_everywhere}};
#endif

KernelChoice g_kernel(kVariants);

// Rows per block: the block's quantized activations stay in L1 / L2, and
// the weight streams from memory once per block.
constexpr int64_t kRowBlock = 64;

// Weights of at least this many bytes split their panels over threads: a
// quarter of the float packed GEMM's threshold, since a quantized weight of
// the same shape streams in a quarter of the time or less (the split
// measured faster from 256 KiB on).
constexpr int64_t kSplitBytes = 256 << 10;

// Threads a product over `w_bytes` of weights in P panels splits over.
int split_parts(int64_t w_bytes, int P, int threads) {
  return threads > 1 && w_bytes >= kSplitBytes ? std::min(threads, P) : 1;
}

// At most this much of the next weight is prefetched between products.
constexpr int64_t kPrefetchBytes = 2 << 20;

} // namespace

const char* qgemm_isa() {
  return g_kernel.get().name;
}

std::string set_qgemm_isa(const std::string& name) {
  return g_kernel.set(name);
}

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
    int threads) {
  const int P = (N + kQPanel - 1) / kQPanel;
  const int G = K / group_size;
  const int64_t w_bytes = int64_t(P) * kQPanel * K / (q_nibbles(bits) ? 2 : 1);
  const int parts = split_parts(w_bytes, P, threads);
  const QKernels& kernels = *g_kernel.get().fn;
  const PanelsFn fn = kernels.fn[q_nibbles(bits) ? 1 : 0][int(st)];
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<qgemm_detail::RowGroup> rg;
  for (int64_t b0 = 0; b0 < M; b0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - b0);
    xq.resize(size_t(rows) * K);
    rg.resize(size_t(rows) * G);
    for (int64_t i = 0; i < rows; ++i) {
      kernels.quantize(
          x + (b0 + i) * K, K, group_size, bits, xq.data() + i * K,
          rg.data() + i * G);
    }
    const Call c{
        xq.data(), rg.data(), rows, K, G, group_size, wq, sb, N, y + b0 * N};
    parallel_panels(P, parts, [&](int p0, int p1) { fn(c, p0, p1); });
  }
}

void qgemm_prefetch_next(
    const uint8_t* wq,
    int P,
    int64_t wq_bytes,
    const void* sb,
    int64_t sb_bytes,
    int threads) {
  if (threads < 2) {
    return;
  }
  const int parts = split_parts(wq_bytes, P, threads);
  // Panels [p0, p1): the worker's first run, else the whole weight.
  const int p0 = parts > 1 ? panel_run_bound(P, parts, 1) : 0;
  const int p1 = parts > 1 ? panel_run_bound(P, parts, 2) : P;
  const int64_t per = wq_bytes / P, sb_per = sb_bytes / P;
  // The ops between two products last tens of microseconds: more than a
  // few MiB would not arrive in time (an LM head can be hundreds of MiB).
  const int64_t budget = kPrefetchBytes * per / (per + sb_per);
  const int64_t n = std::min<int64_t>(p1 - p0, std::max<int64_t>(budget / per, 1));
  const int64_t rest = std::min<int64_t>(p0, std::max<int64_t>(budget / per - n, 0));
  prefetch_in_background(
      {{wq + p0 * per, size_t(n * per)},
       {static_cast<const char*>(sb) + p0 * sb_per, size_t(n * sb_per)},
       {wq, size_t(rest * per)},
       {sb, size_t(rest * sb_per)}});
}

namespace qgemm_detail {

// Row x's groups: int8 values xq and their RowGroup (qgemm.h; xs the float
// sum of x, c = 2^(bits - 1)). A group holding Inf or NaN gets d = NaN and
// xq = 0, so that its outputs are NaN as the dequantized product's would
// be, never a silent number.
//
// Every instruction set runs the same float operations in the same order,
// over kQuantLanes independent lanes (lane l takes k = l mod kQuantLanes):
// per lane the max of |x| (a NaN never replaces it) and the sum, then the
// lanes folded pairwise (l += l + 8, + 4, + 2, + 1); each value rounds to
// the nearest integer, ties to even, as (x * inv + 1.5 * 2^23) - 1.5 *
// 2^23 (exact for |x * inv| <= 127 < 2^22 in the default rounding mode),
// the product rounded first (these files build with -ffp-contract=off).
// So xq and RowGroup are the same bits on every kernel.
void quantize_row_generic(
    const float* x,
    int K,
    int group_size,
    int bits,
    int8_t* xq,
    RowGroup* rg) {
  constexpr int L = kQuantLanes;
  for (int g = 0, k0 = 0; k0 < K; ++g, k0 += group_size) {
    const float* xg = x + k0;
    float amax[L] = {}, sum[L] = {}, nonfinite[L] = {};
    for (int k = 0; k < group_size; k += L) {
      for (int l = 0; l < L; ++l) {
        const float v = xg[k + l];
        const float a = std::fabs(v);
        amax[l] = amax[l] < a ? a : amax[l];
        sum[l] += v;
        nonfinite[l] += v * 0.0f; // NaN once any value is Inf or NaN
      }
    }
    const LaneTotals tot = fold_lanes(amax, sum, nonfinite);
    const bool finite = tot.finite;
    const float inv = group_inverse(tot.amax, finite);
    int32_t qsum = 0;
    int8_t* q = xq + k0;
    for (int k = 0; k < group_size; ++k) {
      const float t = xg[k] * inv;
      const int32_t r = finite ? int32_t((t + kRoundMagic) - kRoundMagic) : 0;
      q[k] = int8_t(r);
      qsum += r;
    }
    finish_group(tot.amax, tot.sum, finite, qsum, bits, rg[g]);
  }
}

} // namespace qgemm_detail
} // namespace mtplx::cpu
