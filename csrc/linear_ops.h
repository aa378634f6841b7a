// Packed Linear weights for the CPU decode GEMM (cpu/packed_gemm.h).
#pragma once

#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mtplx {

namespace mx = mlx::core;

// W [N, K] float32 -> [ceil(N / 48), K, 48]: panels of 48 output columns,
// each column of a panel contiguous over k, the last panel zero padded.
mx::array pack_linear_weight(
    const mx::array& weight,
    mx::StreamOrDevice s = {});

// The inverse: [P, K, 48] -> W [n, K] (n in (48 (P - 1), 48 P]).
mx::array unpack_linear_weight(
    const mx::array& w_packed,
    int n,
    mx::StreamOrDevice s = {});

// x [..., K] float32 @ W^T for W packed by pack_linear_weight, n = W's rows:
// [..., n] float32. Every row's result is one FMA chain over k in order,
// whatever the other rows of x. CPU streams only.
mx::array packed_linear(
    const mx::array& x,
    const mx::array& w_packed,
    int n,
    mx::StreamOrDevice s = {});

// "avx512", "avx2", "neon" or "generic": the kernel this CPU runs.
const char* packed_linear_isa();

// Tests: runs the packed kernels of `isa` ("" restores this CPU's pick);
// returns the previous override (cpu/packed_gemm.h).
std::string set_packed_linear_isa(const std::string& isa);

// x [..., K] @ W^T for an affine-quantized W [n, K] (group_size, bits)
// repacked as cpu/qgemm.h lays out: wq [P, G, S * 256] uint8 and sb [P, G,
// 2, 64] (scales, biases). [..., n] in the promoted dtype of x and sb. Every
// row's result is independent of the other rows of x. CPU streams only.
// `prefetch`: empty, or (wq, sb) of the packed weight the model multiplies
// by next, which the thread pool's idle worker streams toward the caches
// once this product is done, while the ops between the two products run
// (cpu::qgemm_prefetch_next); it changes no result.
mx::array packed_quantized_linear(
    const mx::array& x,
    const mx::array& wq,
    const mx::array& sb,
    int n,
    int group_size,
    int bits,
    const std::vector<mx::array>& prefetch = {},
    mx::StreamOrDevice s = {});

// Rows `ids` (integers, any shape) of a weight packed as
// packed_quantized_linear takes it, in MLX's affine format: (words uint32
// [..., K * bits / 32], scales [..., G], biases [..., G]), bit for bit what
// mx.quantize stored; only those rows are read (an embedding lookup). Ids
// are clamped to [0, n). CPU streams only.
std::vector<mx::array> packed_quantized_rows(
    const mx::array& wq,
    const mx::array& sb,
    const mx::array& ids,
    int n,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// The same rows' values [..., K] in sb's dtype, bit for bit
// mx.dequantize of packed_quantized_rows' output, in one node.
mx::array packed_quantized_embedding(
    const mx::array& wq,
    const mx::array& sb,
    const mx::array& ids,
    int n,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// "amx" (AMX-INT8 for many rows), "avx512" (VNNI), "avx2" or "generic": the
// quantized kernel this CPU runs.
const char* packed_quantized_linear_isa();

// Tests: runs the quantized kernels of `isa` ("" restores this CPU's pick);
// returns the previous override.
std::string set_packed_quantized_linear_isa(const std::string& isa);

} // namespace mtplx
