// y = x W^T for float32 x [M, K] and a Linear weight W [N, K] stored packed:
// panels of kPackedPanel output columns, each panel [K, kPackedPanel] with
// the panel's columns contiguous for every k (the last panel zero padded),
// i.e. the layout W.pad(N to P * kPackedPanel).reshape(P, kPackedPanel,
// K).transpose(0, 2, 1). Weights are packed once, when a model is loaded.
//
// Why packed: in decode and verification shapes (M = 1 to a few dozen rows)
// the product is bound by streaming W from memory at small M and by the FMA
// rate at larger M. A row-major W can only be used by dot products, whose
// inner step loads a full vector of x for every few loads of W, so x (too
// large for L1 at 32 rows) is read again from L2 for every tile of columns.
// With W packed, the inner step is a rank-1 update: one broadcast float of x
// per row and three vectors of W feed 8 x 3 vector FMAs, W streams from
// memory as one sequential run per panel, and x is read 4 bytes at a time.
//
// Every output element is one FMA chain over k = 0 .. K-1 in order, starting
// from zero, whatever M, the row tile it falls in, or how panels are split
// between threads: a row's result does not depend on the other rows of the
// call (plain steps and verifications agree bit for bit).
#pragma once

#include <cstdint>
#include <string>

namespace mtplx {

// Output columns per packed panel: 3 AVX-512 vectors, 6 AVX2 vectors.
constexpr int kPackedPanel = 48;

namespace cpu {

// y [M, N] (row stride N) = x [M, K] (row stride K) @ W^T, W packed as above
// with P = ceil(N / kPackedPanel) panels. Splits the panels over up to
// `threads` threads (the caller included) when W is large enough to pay.
// Requires M >= 0, K >= 1, N >= 1 (the op checks them).
void packed_gemm(
    const float* x,
    int64_t M,
    int K,
    const float* wp,
    int N,
    float* y,
    int threads);

// The instruction set the kernel runs with on this CPU: "avx512", "avx2",
// "neon" or "generic".
const char* packed_gemm_isa();

// Runs the kernels of `name` ("avx512", "avx2", "generic", or "" for the
// CPU's own pick) from now on in this process, so that tests check every
// kernel this CPU can run (they must give the same bits). Returns the
// previous name; throws std::invalid_argument naming `isa` for a name this
// CPU cannot run.
std::string set_packed_gemm_isa(const std::string& name);

namespace packed_detail {

// The row tiles of M rows for a kernel of up to R rows per tile: as few
// tiles as R allows, of sizes as even as possible (the first M % tiles get
// one row more), since every tile reads the weight chunk once more.
struct RowTiles {
  int64_t count, rows, extra;
  RowTiles(int64_t M, int R)
      : count((M + R - 1) / R),
        rows(count ? M / count : 0),
        extra(count ? M % count : 0) {}
  int64_t size(int64_t t) const { return rows + (t < extra); }
  int64_t start(int64_t t) const { return t * rows + (t < extra ? t : extra); }
};

// Rows [0, M) of x, transposed tile by tile (RowTiles(M, the kernel's
// rows)): tile t's r rows from i0 = start(t) are the K x r block at
// xt + i0 * K, xt[i0 * K + k * r + i] = x[i0 + i, k]. A tile's broadcasts
// then read one sequential stream, r floats per k.
struct Call {
  const float* xt;
  int64_t M;
  int K;
  const float* wp;
  int N;
  float* y;
};

// Panels [p0, p1) for every row of the call.
void panels_avx512(const Call& c, int p0, int p1);
void panels_avx2(const Call& c, int p0, int p1);
void panels_generic(const Call& c, int p0, int p1);

// Rows per full tile of each kernel.
constexpr int kRowsAvx512 = 8;
constexpr int kRowsAvx2 = 4;
constexpr int kRowsGeneric = 4;

} // namespace packed_detail
} // namespace cpu
} // namespace mtplx
