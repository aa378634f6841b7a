// The CPU kernels' worker pool (see thread_pool.h).
#include "cpu/thread_pool.h"
#include "cpu/kernel_choice.h"
#include "cpu/pool_chooser.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace mtplx::cpu {

namespace {

int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) {
      return n;
    }
  }
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? int(n) : 1;
}

// MTPLX_CPU_THREADS, parsed once: the thread count, or an error message.
struct EnvThreads {
  int value = 1;
  std::string error;
};

EnvThreads parse_env() {
  constexpr const char* kVar = "MTPLX_CPU_THREADS";
  const char* raw = std::getenv(kVar);
  std::string s = raw ? raw : "";
  const auto space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
  };
  while (!s.empty() && space(s.back())) {
    s.pop_back();
  }
  size_t b = 0;
  while (b < s.size() && space(s[b])) {
    ++b;
  }
  s = s.substr(b);
  EnvThreads e;
  if (s.empty()) {
    e.value = std::min(usable_cpus(), kDefaultCpuThreadsCap);
    return e;
  }
  const bool negative = s[0] == '-';
  const size_t d0 = (s[0] == '-' || s[0] == '+') ? 1 : 0;
  bool digits = d0 < s.size();
  for (size_t i = d0; i < s.size(); ++i) {
    digits &= s[i] >= '0' && s[i] <= '9';
  }
  const std::string quoted = "'" + std::string(raw) + "'";
  if (!digits) {
    e.error = std::string(kVar) + " must be a positive integer, got " + quoted;
    return e;
  }
  // Digits only: compare by length first so that huge values cannot overflow.
  std::string mag = s.substr(d0);
  mag.erase(0, std::min(mag.find_first_not_of('0'), mag.size()));
  const bool zero = mag.empty();
  if (negative || zero) {
    e.error = std::string(kVar) + " must be >= 1, got " + quoted;
    return e;
  }
  if (mag.size() > 4 || std::stoi(mag) > kMaxCpuThreads) {
    e.error = std::string(kVar) + " must be <= " +
        std::to_string(kMaxCpuThreads) + ", got " + quoted;
    return e;
  }
  e.value = std::stoi(mag);
  return e;
}

const EnvThreads& env_threads() {
  static const EnvThreads e = parse_env();
  return e;
}

std::atomic<int> g_override{0};
std::atomic<long long> g_pool_jobs{0};

// How long an idle worker spins for the next job before sleeping.
constexpr auto kSpin = std::chrono::microseconds(1000);

// One turn of a spin wait: yields the core to any other runnable thread
// (another process's, e.g. a second rank on the same cores), so spinning
// never holds a core that someone else needs; when none is runnable it
// returns at once.
inline void spin_pause() {
  std::this_thread::yield();
}

// Spins (yielding) until done() or kSpin has passed; returns done().
template <class Done>
bool spin_until(Done done) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  while (!done() && std::chrono::steady_clock::now() < until) {
    spin_pause();
  }
  return done();
}

class Pool {
 public:
  // Runs the job with up to `threads` threads; false when the pool is busy
  // (another caller's job) or shut down: the caller then runs it alone.
  bool run(int n, int threads, const std::function<void(int)>& f) {
    std::unique_lock<std::mutex> dl(dispatch_, std::try_to_lock);
    if (!dl.owns_lock()) {
      return false;
    }
    uint32_t gen;
    {
      std::lock_guard<std::mutex> lk(m_);
      if (stop_) {
        return false;
      }
      const int want = threads - 1;
      while (int(workers_.size()) < want) {
        try {
          const int id = int(workers_.size());
          workers_.emplace_back([this, id, g = gen_] { worker(id, g); });
        } catch (const std::system_error&) {
          break; // no more threads: run with those we have
        }
      }
      gen = ++gen_;
      published_.store(gen, std::memory_order_release);
      fn_ = &f;
      n_ = n;
      participants_ = std::min(want, int(workers_.size()));
      error_ = nullptr;
      done_.store(0, std::memory_order_relaxed);
      claim_.store(uint64_t(gen) << 32, std::memory_order_release);
    }
    g_pool_jobs.fetch_add(1, std::memory_order_relaxed);
    wake_.notify_all();
    work(gen, n, &f);
    // The workers are usually finishing their last task: spin for them
    // before sleeping (a wake-up costs more than most of these waits).
    spin_until([&] { return done_.load(std::memory_order_acquire) == n; });
    std::exception_ptr err;
    {
      std::unique_lock<std::mutex> lk(m_);
      done_cv_.wait(lk, [&] {
        return done_.load(std::memory_order_acquire) == n;
      });
      fn_ = nullptr;
      err = error_;
      error_ = nullptr;
    }
    if (err) {
      std::rethrow_exception(err);
    }
    return true;
  }

  // Joins the workers (waiting for a job in flight); later jobs run on their
  // callers' threads.
  void shutdown() {
    std::lock_guard<std::mutex> dl(dispatch_);
    std::vector<std::thread> ws;
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
      ws.swap(workers_);
    }
    wake_.notify_all();
    for (auto& t : ws) {
      t.join();
    }
  }

 private:
  void worker(int id, uint32_t seen) {
    std::unique_lock<std::mutex> lk(m_);
    while (true) {
      if (!stop_ && gen_ == seen) {
        // Jobs of a decode step (its GEMMs) come microseconds apart, less
        // than a wake-up through the condition variable costs: spin first.
        // An idle worker meanwhile streams the weight the next job will
        // read (prefetch_in_background), a few KiB between checks.
        lk.unlock();
        const auto until = std::chrono::steady_clock::now() + kSpin;
        while (published_.load(std::memory_order_acquire) == seen) {
          if (id == 0 && prefetch_some()) {
            continue;
          }
          if (std::chrono::steady_clock::now() >= until) {
            break;
          }
          spin_pause();
        }
        lk.lock();
      }
      wake_.wait(lk, [&] { return stop_ || gen_ != seen; });
      if (stop_) {
        return;
      }
      seen = gen_;
      if (id >= participants_) {
        continue;
      }
      const uint32_t g = gen_;
      const int n = n_;
      const std::function<void(int)>* f = fn_;
      lk.unlock();
      work(g, n, f);
      lk.lock();
    }
  }

  // Claims and runs tasks of job `gen` until none is left. A claim only
  // succeeds while the job is unfinished, so `f` is then still alive.
  void work(uint32_t gen, int n, const std::function<void(int)>* f) {
    uint64_t s = claim_.load(std::memory_order_acquire);
    while (uint32_t(s >> 32) == gen && int(uint32_t(s)) < n) {
      if (!claim_.compare_exchange_weak(
              s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        continue;
      }
      try {
        (*f)(int(uint32_t(s)));
      } catch (...) {
        std::lock_guard<std::mutex> lk(m_);
        if (!error_) {
          error_ = std::current_exception();
        }
      }
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        std::lock_guard<std::mutex> lk(m_);
        done_cv_.notify_all();
      }
      s = claim_.load(std::memory_order_acquire);
    }
  }

  // Prefetches the next chunk of the pending background ranges, if any;
  // whether some remain.
  bool prefetch_some() {
    const uint32_t want = pf_gen_.load(std::memory_order_acquire);
    if (want != pf_seen_) {
      std::lock_guard<std::mutex> lk(pf_m_);
      pf_work_ = pf_ranges_;
      pf_seen_ = pf_gen_.load(std::memory_order_relaxed);
      pf_at_ = 0;
      pf_off_ = 0;
    }
    for (int lines = 0; lines < kPrefetchLines && pf_at_ < pf_work_.size();) {
      const PrefetchRange& r = pf_work_[pf_at_];
      const char* p = static_cast<const char*>(r.begin);
      for (; pf_off_ < r.bytes && lines < kPrefetchLines;
           pf_off_ += 64, ++lines) {
        __builtin_prefetch(p + pf_off_, 0, 2);
      }
      if (pf_off_ >= r.bytes) {
        ++pf_at_;
        pf_off_ = 0;
      }
    }
    return pf_at_ < pf_work_.size();
  }

 public:
  void request_prefetch(const std::vector<PrefetchRange>& ranges) {
    {
      std::lock_guard<std::mutex> lk(pf_m_);
      pf_ranges_ = ranges;
    }
    pf_gen_.fetch_add(1, std::memory_order_release);
  }

 private:
  static constexpr int kPrefetchLines = 64;
  std::mutex pf_m_;
  std::vector<PrefetchRange> pf_ranges_; // guarded by pf_m_
  std::atomic<uint32_t> pf_gen_{0};
  // Worker 0's copy and cursor (only it touches them).
  std::vector<PrefetchRange> pf_work_;
  uint32_t pf_seen_ = 0;
  size_t pf_at_ = 0, pf_off_ = 0;

  std::mutex dispatch_; // one job at a time
  std::mutex m_; // guards everything below but the atomics
  std::condition_variable wake_;
  std::condition_variable done_cv_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  uint32_t gen_ = 0;
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0;
  int participants_ = 0; // workers [0, participants_) take part in the job
  std::exception_ptr error_;
  std::atomic<uint64_t> claim_{0}; // job generation << 32 | next task
  std::atomic<uint32_t> published_{0}; // gen_, readable without m_
  std::atomic<int> done_{0}; // tasks of the job finished
};

Chooser g_chooser;

// The pool is never destroyed (callers may arrive during exit); its workers
// are joined at exit by the reaper below. After fork() the child, which has
// none of the parent's workers, starts a fresh pool (the old one is leaked).
std::atomic<Pool*> g_pool{nullptr};

#if defined(__unix__) || defined(__APPLE__)
void after_fork_in_child() {
  g_pool.store(new Pool, std::memory_order_release);
}
#endif

Pool* pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) {
    return p;
  }
  Pool* fresh = new Pool;
  if (!g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) {
    delete fresh;
    return p;
  }
#if defined(__unix__) || defined(__APPLE__)
  pthread_atfork(nullptr, nullptr, after_fork_in_child);
#endif
  return fresh;
}

struct Reaper {
  ~Reaper() {
    if (Pool* p = g_pool.load(std::memory_order_acquire)) {
      p->shutdown();
    }
  }
} g_reaper;

} // namespace

int cpu_threads() {
  if (int o = g_override.load(std::memory_order_relaxed); o > 0) {
    return o;
  }
  const EnvThreads& e = env_threads();
  if (!e.error.empty()) {
    throw std::invalid_argument(e.error);
  }
  return e.value;
}

int cpu_threads_or_one() noexcept {
  if (int o = g_override.load(std::memory_order_relaxed); o > 0) {
    return o;
  }
  const EnvThreads& e = env_threads();
  return e.error.empty() ? e.value : 1;
}

int set_cpu_threads(int n) {
  if (n < 0 || n > kMaxCpuThreads) {
    throw std::invalid_argument(
        "cpu thread count must be in [0, " + std::to_string(kMaxCpuThreads) +
        "], got " + std::to_string(n));
  }
  const int previous = g_override.exchange(n, std::memory_order_relaxed);
  g_chooser.reset();
  return previous;
}

long long pool_jobs() noexcept {
  return g_pool_jobs.load(std::memory_order_relaxed);
}

void parallel_for_pooled(
    int n,
    int threads,
    const std::function<void(int)>& f) {
  threads = std::min(threads, n);
  if (threads < 2 || !pool()->run(n, threads, f)) {
    for (int i = 0; i < n; ++i) {
      f(i);
    }
  }
}

void prefetch_in_background(const std::vector<PrefetchRange>& ranges) {
  if (cpu_threads_or_one() > 1) {
    pool()->request_prefetch(ranges);
  }
}

void parallel_for(
    int n,
    int threads,
    const std::function<void(int)>& f,
    double cost) {
  threads = std::min(threads, n);
  if (threads < 2) {
    for (int i = 0; i < n; ++i) {
      f(i);
    }
    return;
  }
  const bool want_pool = g_chooser.use_pool();
  const auto t0 = std::chrono::steady_clock::now();
  bool pooled = want_pool && pool()->run(n, threads, f);
  if (!pooled) {
    for (int i = 0; i < n; ++i) {
      f(i);
    }
  }
  const double wall = std::chrono::duration<double>(
                          std::chrono::steady_clock::now() - t0)
                          .count();
  g_chooser.record(pooled, wall / (cost > 0 ? cost : double(n)));
}



// cpu/kernel_choice.h
void parallel_panels(
    int P,
    int parts,
    const std::function<void(int, int)>& f) {
  if (parts <= 1) {
    f(0, P);
    return;
  }
  const int tasks = P >= 3 * parts ? 3 * parts : P;
  parallel_for_pooled(tasks, parts, [&](int t) {
    f(panel_run_bound(P, parts, t), panel_run_bound(P, parts, t + 1));
  });
}

int panel_run_bound(int P, int parts, int t) {
  if (parts <= 1) {
    return t > 0 ? P : 0;
  }
  if (P < 3 * parts) {
    return std::min(t, P);
  }
  const int tasks = 3 * parts;
  const int64_t head = int64_t(P) * 3 / 4;
  if (t <= parts) {
    return int(head * t / parts);
  }
  return int(head + (P - head) * (std::min(t, tasks) - parts) / (tasks - parts));
}

} // namespace mtplx::cpu
