// The thread pool's choice between its workers and the caller's thread
// alone (see thread_pool.cpp's parallel_for). Internal to the pool.
#pragma once

#include <algorithm>
#include <mutex>

namespace mtplx::cpu {

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

} // namespace mtplx::cpu
