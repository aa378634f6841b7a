// Two-thread decode GEMM: the calling thread computes the first half of the
// output columns, one worker thread owned by this library the second half.
#pragma once

namespace mtplx {

// C = alpha * A B^T + beta * C (decode_gemm.h) with columns split between
// the caller and the worker. Returns false, having computed nothing, when it
// cannot split: N too narrow for two parts, or the worker busy with another
// caller's product (the caller then computes it alone).
bool split_columns(
    int M,
    int N,
    int K,
    float alpha,
    const float* a,
    int lda,
    const float* b,
    int ldb,
    float beta,
    float* c,
    int ldc);

}  // namespace mtplx
