// A tiny library that exports the cblas_* GEMM symbols libmlx imports on
// Linux and forwards them to an OpenBLAS whose symbols carry a prefix (the
// scipy-openblas32 wheel exports scipy_cblas_sgemm, ...).
//
// Decode-sized float32 products x @ W^T (up to 64 rows of x against a weight
// matrix, the Linear layers of a decode or verification step) run in the
// decode GEMM here instead (decode_gemm.h): OpenBLAS packs the whole weight
// matrix on every call, which costs more than the product itself at a few
// rows, and it reads W once per call whatever the row count. Large weights
// split their columns between the calling thread and one worker thread of
// this library. The older small-row kernel (small_gemm.h, at most 8 rows, one
// thread) stays selectable for comparisons.
//
// Loaded with RTLD_GLOBAL before libmlx, its definitions come first in the
// global symbol scope, so libmlx's calls bind here instead of to the
// reference BLAS bundled with the mlx wheel. The OpenBLAS library is opened at
// run time (mtplx_blas_bind) so that this shim builds without it.

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "decode_gemm.h"
#include "small_gemm.h"
#include "split_worker.h"

namespace {

// CBLAS enums are plain C ints (CblasRowMajor = 101, CblasNoTrans = 111, ...);
// scipy-openblas32 uses 32-bit integers (blasint = int).
using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*,
                          int, const float*, int, float, float*, int);
using dgemm_fn = void (*)(int, int, int, int, int, int, double, const double*,
                          int, const double*, int, double, double*, int);
using cgemm_fn = void (*)(int, int, int, int, int, int, const void*,
                          const void*, int, const void*, int, const void*,
                          void*, int);
using set_threads_fn = void (*)(int);
using get_threads_fn = int (*)();
using get_config_fn = char* (*)();

sgemm_fn g_sgemm = nullptr;
dgemm_fn g_dgemm = nullptr;
cgemm_fn g_cgemm = nullptr;
set_threads_fn g_set_threads = nullptr;
get_threads_fn g_get_threads = nullptr;
get_config_fn g_get_config = nullptr;
void* g_handle = nullptr;
// Counts forwarded GEMM calls: the loader's proof that libmlx really calls
// through this library.
std::atomic<long long> g_calls{0};
// Counts products the small kernel computed (the tests' proof it is used).
std::atomic<long long> g_small_calls{0};
// Counts decode-GEMM products whose columns were split over two threads.
std::atomic<long long> g_split_calls{0};
std::atomic<int> g_small_rows{mtplx::kDecodeGemmMaxRows};
// 0: the decode GEMM; 1: the older small-row kernel (<= 8 rows).
std::atomic<int> g_kernel{0};
// Bytes of W from which the decode GEMM splits its columns over two threads
// (below it one thread is faster: the hand-off costs more than it saves).
std::atomic<long long> g_split_bytes{16LL << 20};
char g_error[512] = "";

void* sym(const std::string& prefix, const char* name) {
  return dlsym(g_handle, (prefix + name).c_str());
}

void missing(const char* what) {
  std::fprintf(stderr,
               "mtplx_ext blas shim: %s called before mtplx_blas_bind "
               "succeeded; aborting\n",
               what);
  std::abort();
}

}  // namespace

extern "C" {

// Opens `path` and resolves `<prefix>cblas_{s,d,c}gemm`. Returns 0 on success;
// on failure returns non-zero and mtplx_blas_error() says why.
__attribute__((visibility("default"))) int mtplx_blas_bind(const char* path,
                                                           const char* prefix) {
  if (g_sgemm != nullptr) return 0;
  std::string p = prefix ? prefix : "";
  g_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (g_handle == nullptr) {
    std::snprintf(g_error, sizeof(g_error), "dlopen failed: %s", dlerror());
    return 1;
  }
  auto s = reinterpret_cast<sgemm_fn>(sym(p, "cblas_sgemm"));
  auto d = reinterpret_cast<dgemm_fn>(sym(p, "cblas_dgemm"));
  auto c = reinterpret_cast<cgemm_fn>(sym(p, "cblas_cgemm"));
  if (s == nullptr || d == nullptr || c == nullptr) {
    std::snprintf(g_error, sizeof(g_error),
                  "%s lacks %scblas_sgemm/dgemm/cgemm", path, p.c_str());
    return 2;
  }
  g_set_threads = reinterpret_cast<set_threads_fn>(sym(p, "openblas_set_num_threads"));
  g_get_threads = reinterpret_cast<get_threads_fn>(sym(p, "openblas_get_num_threads"));
  g_get_config = reinterpret_cast<get_config_fn>(sym(p, "openblas_get_config"));
  g_dgemm = d;
  g_cgemm = c;
  g_sgemm = s;
  return 0;
}

__attribute__((visibility("default"))) const char* mtplx_blas_error() {
  return g_error;
}

__attribute__((visibility("default"))) long long mtplx_blas_calls() {
  return g_calls.load(std::memory_order_relaxed);
}

__attribute__((visibility("default"))) long long mtplx_blas_small_calls() {
  return g_small_calls.load(std::memory_order_relaxed);
}

__attribute__((visibility("default"))) long long mtplx_blas_split_calls() {
  return g_split_calls.load(std::memory_order_relaxed);
}

// Most rows the shim's own kernels take (0: every product goes to OpenBLAS);
// clamped to [0, kDecodeGemmMaxRows]. Returns the previous value.
__attribute__((visibility("default"))) int mtplx_blas_set_small_rows(int n) {
  n = n < 0 ? 0 : (n > mtplx::kDecodeGemmMaxRows ? mtplx::kDecodeGemmMaxRows : n);
  return g_small_rows.exchange(n, std::memory_order_relaxed);
}

// 0: the decode GEMM, 1: the older small-row kernel (which takes at most
// kSmallGemmMaxRows rows; more go to OpenBLAS). Returns the previous value,
// or -1 (and no change) for any other value.
__attribute__((visibility("default"))) int mtplx_blas_set_kernel(int kernel) {
  if (kernel != 0 && kernel != 1) return -1;
  return g_kernel.exchange(kernel, std::memory_order_relaxed);
}

// Bytes of W (N * K * 4) from which the decode GEMM uses two threads; a
// negative value never splits. Returns the previous value.
__attribute__((visibility("default"))) long long mtplx_blas_set_split_bytes(
    long long bytes) {
  return g_split_bytes.exchange(bytes, std::memory_order_relaxed);
}

__attribute__((visibility("default"))) int mtplx_blas_set_threads(int n) {
  if (g_set_threads == nullptr) return 1;
  g_set_threads(n);
  return 0;
}

__attribute__((visibility("default"))) int mtplx_blas_get_threads() {
  return g_get_threads ? g_get_threads() : -1;
}

__attribute__((visibility("default"))) const char* mtplx_blas_config() {
  return g_get_config ? g_get_config() : "";
}

__attribute__((visibility("default"))) void cblas_sgemm(
    int order, int ta, int tb, int m, int n, int k, float alpha, const float* a,
    int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  if (g_sgemm == nullptr) missing("cblas_sgemm");
  g_calls.fetch_add(1, std::memory_order_relaxed);
  if (mtplx::small_gemm_applies(
          order, ta, tb, m, n, k, g_small_rows.load(std::memory_order_relaxed))) {
    if (g_kernel.load(std::memory_order_relaxed) == 0) {
      g_small_calls.fetch_add(1, std::memory_order_relaxed);
      const long long split = g_split_bytes.load(std::memory_order_relaxed);
      if (split >= 0 && int64_t(n) * k * 4 >= split &&
          mtplx::split_columns(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) {
        g_split_calls.fetch_add(1, std::memory_order_relaxed);
      } else {
        mtplx::decode_gemm_columns(m, 0, n, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      }
      return;
    }
    if (m <= mtplx::kSmallGemmMaxRows) {
      g_small_calls.fetch_add(1, std::memory_order_relaxed);
      mtplx::small_gemm_nt(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
  }
  g_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

__attribute__((visibility("default"))) void cblas_dgemm(
    int order, int ta, int tb, int m, int n, int k, double alpha,
    const double* a, int lda, const double* b, int ldb, double beta, double* c,
    int ldc) {
  if (g_dgemm == nullptr) missing("cblas_dgemm");
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

__attribute__((visibility("default"))) void cblas_cgemm(
    int order, int ta, int tb, int m, int n, int k, const void* alpha,
    const void* a, int lda, const void* b, int ldb, const void* beta, void* c,
    int ldc) {
  if (g_cgemm == nullptr) missing("cblas_cgemm");
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // extern "C"
