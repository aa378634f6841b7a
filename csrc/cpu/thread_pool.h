// A small persistent worker pool for the CPU kernels' independent rows.
//
// Threads are created on first use and reused; parallel_for runs tasks on
// the calling thread too (MLX's CPU stream thread), so a job never waits for
// a worker that cannot start. One job runs at a time: a second caller (another
// stream) that finds the pool busy runs its tasks on its own thread instead of
// waiting. Workers are joined at process exit and recreated after fork().
// When the machine's other cores are busy, workers get preempted mid-task and
// a job can take longer on the pool than on one thread: parallel_for measures
// both ways of running and mostly takes the faster one (see Chooser).
//
// Thread count: MTPLX_CPU_THREADS (a positive integer, at most
// kMaxCpuThreads), else the CPUs this process may run on (sched_getaffinity)
// capped at kDefaultCpuThreadsCap. 1 runs every task on the calling thread.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

namespace mtplx::cpu {

constexpr int kMaxCpuThreads = 256;
constexpr int kDefaultCpuThreadsCap = 8;

// The configured thread count (>= 1). Throws std::invalid_argument naming
// MTPLX_CPU_THREADS when the variable holds anything but an integer in
// [1, kMaxCpuThreads]; the variable is read once per process.
int cpu_threads();

// cpu_threads() for code that must not throw (kernel bodies): 1 when the
// variable is invalid (the ops check it before anything runs).
int cpu_threads_or_one() noexcept;

// Overrides the thread count for this process (tests and benchmarks);
// n = 0 returns to MTPLX_CPU_THREADS / the default. Returns the previous
// override (0: none). Also clears the measurements that choose between the
// pool and the caller's thread.
int set_cpu_threads(int n);

// How many jobs have run on the pool's workers in this process (tests:
// whether a job was handed to workers).
long long pool_jobs() noexcept;

// Runs f(i) for every i in [0, n) on up to `threads` threads, the caller
// included, and returns when all are done. Tasks are claimed dynamically, so
// which thread runs a task varies; each task must only touch its own outputs
// (and thread_local scratch). The first exception a task throws is rethrown
// here after the other tasks finish. `cost` (any unit, e.g. estimated
// nanoseconds; 0: n) normalises the job's wall time when comparing the pool
// with the caller's thread alone.
void parallel_for(
    int n,
    int threads,
    const std::function<void(int)>& f,
    double cost = 0);

// parallel_for for jobs that always pay on more threads (products over
// megabytes of weights): the pool whenever it is free, no measurements.
// Tasks are claimed dynamically, so when a worker is preempted the caller
// takes the tasks it has not started; cut a job into a few tasks per thread.
void parallel_for_pooled(
    int n,
    int threads,
    const std::function<void(int)>& f);

// A range of memory for prefetch_in_background.
struct PrefetchRange {
  const void* begin;
  size_t bytes;
};

// Asks the pool's first worker, while it waits for its next job, to stream
// `ranges` toward the caches (prefetch instructions only: nothing is read,
// nothing faults). A newer request replaces an unfinished one; a job
// interrupts it within a few KiB and it resumes after. Best effort: nothing
// happens on one thread or while the worker sleeps.
void prefetch_in_background(const std::vector<PrefetchRange>& ranges);

} // namespace mtplx::cpu
