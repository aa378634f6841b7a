// Run-time choice between the instruction-set variants of a CPU kernel: the
// fastest variant this CPU runs, overridable per process (tests run every
// variant the CPU can run and compare their bits), and the split of a
// kernel's weight panels over the CPU pool. Shared by the float packed GEMM
// and the quantized one.
#pragma once

#include <atomic>
#include <functional>
#include <stdexcept>
#include <string>

namespace mtplx::cpu {

// One variant: its entry point, name ("avx512", "avx2", "generic") and
// whether this CPU can run it.
template <class Fn>
struct KernelVariant {
  Fn fn;
  const char* name;
  bool (*runs)();
};

// A table of variants, fastest first, the last one running everywhere.
template <class Fn, int N>
class KernelChoice {
 public:
  explicit KernelChoice(const KernelVariant<Fn> (&table)[N]) : table_(table) {}

  // The override if any, else the first variant this CPU runs (looked up
  // once).
  const KernelVariant<Fn>& get() const {
    if (const auto* o = override_.load(std::memory_order_acquire)) {
      return *o;
    }
    const auto* p = pick_.load(std::memory_order_acquire);
    if (p == nullptr) {
      p = &table_[N - 1];
      for (const auto& v : table_) {
        if (v.runs()) {
          p = &v;
          break;
        }
      }
      pick_.store(p, std::memory_order_release);
    }
    return *p;
  }

  // Runs `name` from now on ("" returns to the CPU's pick); returns the
  // previous override's name ("" for none). Throws std::invalid_argument
  // naming `isa` for a name this table lacks or this CPU cannot run.
  std::string set(const std::string& name) {
    const KernelVariant<Fn>* next = nullptr;
    if (!name.empty()) {
      for (const auto& v : table_) {
        if (name == v.name && v.runs()) {
          next = &v;
        }
      }
      if (next == nullptr) {
        std::string names;
        for (const auto& v : table_) {
          names += (names.empty() ? "\"" : ", \"") + std::string(v.name) + "\"";
        }
        throw std::invalid_argument(
            "isa must be one of " + names + " and run on this CPU, got \"" +
            name + "\"");
      }
    }
    const auto* previous = override_.exchange(next, std::memory_order_acq_rel);
    return previous ? previous->name : "";
  }

 private:
  const KernelVariant<Fn> (&table_)[N];
  std::atomic<const KernelVariant<Fn>*> override_{nullptr};
  mutable std::atomic<const KernelVariant<Fn>*> pick_{nullptr};
};

inline bool runs_everywhere() {
  return true;
}

// Runs f(p0, p1) over runs of the panels [0, P) on up to `parts` threads
// (parts >= 1; 1: one call on this thread). Runs are claimed in order:
// first one long run per thread (three quarters of the panels), then two
// short runs per thread, so that a thread that is behind (preempted, or
// woken late) leaves only short runs to the others at the end. With fewer
// panels than that, one run per panel. Each panel's result must not depend
// on the run it falls in.
void parallel_panels(
    int P,
    int parts,
    const std::function<void(int, int)>& f);

// The runs parallel_panels(P, parts, ...) cuts, as bounds: run t is
// [panel_run_bound(P, parts, t), panel_run_bound(P, parts, t + 1)); runs
// 0 .. parts - 1 are the long ones (claimed first, one per thread).
int panel_run_bound(int P, int parts, int t);

} // namespace mtplx::cpu
