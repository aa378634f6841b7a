// The CPU kernels' worker pool (see thread_pool.h).
#include "cpu/thread_pool.h"
#include "cpu/kernel_choice.h"

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
        lk.unlock();
        spin_until([&] {
          return published_.load(std::memory_order_acquire) != seen;
        });
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

// Whether a job runs on the pool or on the caller's thread alone, decided
// from measured outcomes. On a machine whose other cores are busy a worker
// may sit preempted in the middle of a task while the caller, done with the
// rest, waits for it, or share a core with the caller: a job can then take
// longer on the pool than on one thread. Each job's wall time per unit of
// its estimated cost is recorded for the way it ran; jobs mostly take the
// way with the lower median pace over its last kWindow recorded jobs, in
// cycles of 8 jobs (16 when one way is over 1.3x faster) that end with one
// serial job, or with kBurst pooled jobs, to keep both measurements current.
// A pooled job right after a serial one is not recorded: a worker core that
// sat idle (on a virtual machine, possibly descheduled) wakes slowly, which
// says nothing about back-to-back jobs. Until both ways have kWarmup
// recorded jobs, jobs go pool, pool, serial, pool, pool, serial, ...
class Chooser {
 public:
  static constexpr int kWindow = 4;
  static constexpr int kWarmup = 3;
  static constexpr int kBurst = 3;

  bool use_pool() {
    std::lock_guard<std::mutex> lk(m_);
    const long long job = jobs_++;
    if (std::min(count_[0], count_[1]) < kWarmup) {
      return job % 3 != 2;
    }
    const double serial = median(0), pooled = median(1);
    const bool pool_better = pooled < serial;
    const double ratio = pool_better ? serial / pooled : pooled / serial;
    const int cycle = ratio > 1.3 ? 16 : 8;
    const int pos = int(job % cycle);
    return pool_better ? pos != cycle - 1 : pos >= cycle - kBurst;
  }

  void record(bool pooled, double pace) {
    std::lock_guard<std::mutex> lk(m_);
    const bool cold = pooled && !last_pooled_;
    last_pooled_ = pooled;
    if (cold) {
      return;
    }
    const int m = pooled ? 1 : 0;
    window_[m][count_[m] % kWindow] = pace;
    ++count_[m];
  }

  void reset() {
    std::lock_guard<std::mutex> lk(m_);
    count_[0] = count_[1] = 0;
    jobs_ = 0;
    last_pooled_ = false;
  }

 private:
  double median(int m) const {
    const int k = std::min(count_[m], kWindow);
    double v[kWindow];
    std::copy(window_[m], window_[m] + k, v);
    std::sort(v, v + k);
    return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
  }

  std::mutex m_;
  double window_[2][kWindow] = {};
  int count_[2] = {0, 0};
  long long jobs_ = 0;
  bool last_pooled_ = false;
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
  const bool guided = P >= 3 * parts;
  const int tasks = guided ? 3 * parts : P;
  const int64_t head = int64_t(P) * 3 / 4;
  const auto bound = [&](int t) -> int {
    if (!guided) {
      return t;
    }
    if (t <= parts) {
      return int(head * t / parts);
    }
    return int(head + (P - head) * (t - parts) / (tasks - parts));
  };
  parallel_for_pooled(tasks, parts, [&](int t) { f(bound(t), bound(t + 1)); });
}

} // namespace mtplx::cpu
