// The worker thread behind split_columns. One worker, started on first use
// and never joined (it sleeps on a condition variable between products; at
// exit the process ends it). After a fork the child starts its own.
//
// The columns are handed out in chunks from a shared counter rather than as
// fixed halves: on a loaded machine the worker's core may be busy, and then
// the caller takes the chunks itself instead of waiting for it. A product
// whose chunks the worker never got to is cancelled for the worker, so the
// caller waits at most for the chunk the worker is in. The worker spins for
// a short while after each product before sleeping, since a decode step's
// products come a few microseconds apart and a wake-up costs more than that.
#include "split_worker.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "decode_gemm.h"

namespace mtplx {
namespace {

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

struct Job {
  int M, N, K;
  float alpha;
  const float* a;
  int lda;
  const float* b;
  int ldb;
  float beta;
  float* c;
  int ldc;
  int chunk;  // columns per chunk, a multiple of kDecodeSplitAlign
  int chunks;
};

// States of a posted product for the worker.
enum : int { kIdle = 0, kPosted = 1, kTaken = 2, kCancelled = 3 };

// How long the worker spins for the next product before sleeping.
constexpr auto kSpin = std::chrono::microseconds(50);

struct Worker {
  std::mutex busy;  // held by the caller whose product is in flight
  std::mutex m;
  std::condition_variable cv;
  std::atomic<int> state{kIdle};
  std::atomic<int> next{0};  // next chunk to compute
  std::atomic<bool> done{false};  // the worker left the taken product
  Job job{};

  // Computes chunks until none is left.
  void work() {
    const Job& j = job;
    for (int i = next.fetch_add(1); i < j.chunks; i = next.fetch_add(1)) {
      const int n0 = i * j.chunk;
      const int n1 = n0 + j.chunk < j.N ? n0 + j.chunk : j.N;
      decode_gemm_columns(
          j.M, n0, n1, j.N, j.K, j.alpha, j.a, j.lda, j.b, j.ldb, j.beta, j.c,
          j.ldc);
    }
  }

  void run() {
    for (;;) {
      auto until = std::chrono::steady_clock::now() + kSpin;
      while (state.load(std::memory_order_acquire) != kPosted) {
        if (std::chrono::steady_clock::now() < until) {
          pause();
          continue;
        }
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] {
          return state.load(std::memory_order_acquire) == kPosted;
        });
      }
      int expected = kPosted;
      if (!state.compare_exchange_strong(expected, kTaken)) continue;
      work();
      done.store(true, std::memory_order_release);
    }
  }
};

Worker* g_worker = nullptr;
std::mutex g_start;

void forget_worker_in_child() {
  // The child has no worker thread; its state is abandoned, not destroyed.
  g_worker = nullptr;
}

Worker* worker() {
  std::lock_guard<std::mutex> lock(g_start);
  if (g_worker == nullptr) {
    static bool registered = false;
    if (!registered) {
      pthread_atfork(nullptr, nullptr, forget_worker_in_child);
      registered = true;
    }
    auto* w = new Worker();
    std::thread([w] { w->run(); }).detach();
    g_worker = w;
  }
  return g_worker;
}

}  // namespace

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
    int ldc) {
  // Chunks of about 128 KiB of W (at least one tile width): small enough
  // that a late worker costs little, large enough to amortize the counter.
  int chunk = int((128 * 1024) / (int64_t(K) * 4));
  chunk = chunk < kDecodeSplitAlign
      ? kDecodeSplitAlign
      : chunk / kDecodeSplitAlign * kDecodeSplitAlign;
  const int chunks = (N + chunk - 1) / chunk;
  if (chunks < 2) return false;
  Worker* w = worker();
  std::unique_lock<std::mutex> busy(w->busy, std::try_to_lock);
  if (!busy.owns_lock()) return false;
  w->job = Job{M, N, K, alpha, a, lda, b, ldb, beta, c, ldc, chunk, chunks};
  w->next.store(0, std::memory_order_relaxed);
  w->done.store(false, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(w->m);
    w->state.store(kPosted, std::memory_order_release);
  }
  w->cv.notify_one();
  w->work();
  int expected = kPosted;
  if (!w->state.compare_exchange_strong(expected, kCancelled)) {
    // The worker took the product: wait for the chunk it is in.
    for (int spins = 0; !w->done.load(std::memory_order_acquire); ++spins) {
      if (spins < 100000) {
        pause();
      } else {
        std::this_thread::yield();
      }
    }
  }
  w->state.store(kIdle, std::memory_order_release);
  return true;
}

}  // namespace mtplx
