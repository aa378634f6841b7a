// Threadgroup emulator runtime: runs the threads of one threadgroup as fibers
// under a deterministic scheduler, so that barriers, threadgroup
// memory and 32-lane simd-group functions behave as on Apple GPUs. Threads
// switch only at simd functions, barriers and exit. Fails loudly on:
//   * a barrier that some threads reach and others skip (deadlock) or
//     threads waiting at different barriers;
//   * out-of-bounds or misaligned device buffer accesses;
//   * threadgroup memory races: an element written by one thread and read or
//     written by another with no barrier between, and reads of threadgroup
//     memory that nothing wrote;
//   * simd shuffles / broadcasts whose lane argument is not uniform;
//   * a launch that runs past its time-out (runaway loop).
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700 // macOS hides ucontext without it
#endif
#include <sys/mman.h>
#include <ucontext.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "emu_registry.h"

// Fiber switch. On x86-64 a few instructions (callee-saved registers and the
// stack pointer); elsewhere ucontext, whose swapcontext costs a syscall.
#if defined(__x86_64__) && defined(__ELF__) && !defined(MEMU_USE_UCONTEXT)
#define MEMU_ASM_SWITCH 1
extern "C" void memu_switch(void** save_sp, void* new_sp);
extern "C" void memu_trampoline();
asm(R"(
  .text
  .globl memu_switch
  .type memu_switch, @function
memu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size memu_switch, .-memu_switch

  .globl memu_trampoline
  .type memu_trampoline, @function
memu_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size memu_trampoline, .-memu_trampoline
)");
#endif

namespace metal_emu {

namespace {

constexpr int kSimdWidth = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kMaxThreadgroupMemory = 32 * 1024;
constexpr size_t kStackSize = 256 * 1024;
constexpr unsigned char kTgPoison = 0xA5;

struct EmuError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class State { runnable, at_barrier, at_simd, done };

struct Touch {
  TgAlloc* alloc;
  size_t elem;
  unsigned char old[16];
};

struct Thread {
  uint32_t tid = 0, lane = 0, sg = 0;
  uint32_t local[3] = {0, 0, 0};
  State state = State::runnable;
  Site site{};
  const char* op = nullptr;
  SimdResolver resolver = nullptr;
  bool simd_barrier = false;
  unsigned flags = 0;
  SimdSlot slot{};
#ifdef MEMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx{};
#endif
  unsigned char* stack = nullptr;
  std::vector<Touch> touches;
};

// Shadow state of one threadgroup memory element, for race detection.
struct Shadow {
  uint64_t write_epoch = 0;
  int32_t writer = -1;
  uint64_t writer_sg_epoch = 0;
  uint64_t touch_epoch = 0;
  int32_t toucher = -1;
  bool multi = false;
  bool init = false;
  uint64_t seg = 0; // segment that last recorded a touch (dedup)
};

struct Alloc {
  TgAlloc a{};
  std::vector<unsigned char> storage;
  std::vector<Shadow> shadow;
};

struct Launch {
  const KernelInfo* kernel = nullptr;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t tg[3] = {1, 1, 1};
  uint32_t group[3] = {0, 0, 0};
  int nthreads = 0;
  std::vector<BufferInfo> buffers;
  std::vector<uint64_t> tg_param_lengths;
  std::string error;
  // Per threadgroup.
  std::vector<Thread> threads;
  Thread* current = nullptr;
#ifdef MEMU_ASM_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched{};
#endif
  std::map<const void*, Alloc> allocs; // keyed by declaration site
  std::map<int, Alloc> param_allocs; // [[threadgroup(n)]] parameters
  size_t tg_bytes = 0;
  uint64_t epoch = 1; // advances at threadgroup_barrier(mem_threadgroup)
  std::vector<uint64_t> sg_epoch; // advances at simdgroup_barrier
  uint64_t segment = 0;
};

Launch* g_launch = nullptr;
std::mutex g_launch_mutex; // one launch at a time
std::vector<unsigned char*> g_stacks;

std::map<std::string, KernelInfo>& registry() {
  static std::map<std::string, KernelInfo> r;
  return r;
}

std::string site_str(const Site& s) {
  std::string f = s.file ? s.file : "?";
  auto slash = f.rfind('/');
  if (slash != std::string::npos) {
    f = f.substr(slash + 1);
  }
  return f + ":" + std::to_string(s.line);
}

std::string where() {
  Launch& L = *g_launch;
  std::ostringstream os;
  os << "kernel " << L.kernel->name << ", threadgroup (" << L.group[0] << ","
     << L.group[1] << "," << L.group[2] << ")";
  if (L.current) {
    os << ", thread " << L.current->tid;
  }
  return os.str();
}

// Ranges of thread ids, e.g. "0-31, 64".
std::string id_list(const std::vector<uint32_t>& ids) {
  std::ostringstream os;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) {
      ++j;
    }
    os << (i ? ", " : "") << ids[i];
    if (j > i) {
      os << "-" << ids[j];
    }
    i = j + 1;
  }
  return os.str();
}

void yield_to_scheduler() {
  Launch& L = *g_launch;
  Thread* t = L.current;
#ifdef MEMU_ASM_SWITCH
  memu_switch(&t->sp, L.sched_sp);
#else
  swapcontext(&t->ctx, &L.sched);
#endif
}

void fiber_main(int idx) {
  Launch& L = *g_launch;
  Thread& t = L.threads[idx];
  try {
    L.kernel->invoke();
  } catch (const EmuError& e) {
    if (L.error.empty()) {
      L.error = e.what();
    }
  } catch (const std::exception& e) {
    if (L.error.empty()) {
      L.error = where() + ": " + e.what();
    }
  }
  t.state = State::done;
#ifdef MEMU_ASM_SWITCH
  memu_switch(&t.sp, L.sched_sp); // never resumed
  __builtin_trap();
#endif
  // (ucontext: uc_link returns to the scheduler.)
}

#ifdef MEMU_ASM_SWITCH
void fiber_entry(long idx) {
  fiber_main(int(idx));
}
#endif

unsigned char* stack_for(size_t i) {
  while (g_stacks.size() <= i) {
    void* p = mmap(
        nullptr,
        kStackSize,
        PROT_READ | PROT_WRITE,
        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
        -1,
        0);
    if (p == MAP_FAILED) {
      throw std::runtime_error("metal emulator: cannot map a fiber stack");
    }
    mprotect(p, 4096, PROT_NONE); // guard page: overflow faults loudly
    g_stacks.push_back(static_cast<unsigned char*>(p));
  }
  return g_stacks[i];
}

// Race bookkeeping for the accesses of the segment a thread just ran.
void check_segment(Thread& t) {
  Launch& L = *g_launch;
  for (auto& tc : t.touches) {
    // TgAlloc is the first member of Alloc.
    Alloc* al = reinterpret_cast<Alloc*>(tc.alloc);
    Shadow& sh = al->shadow[tc.elem];
    const size_t es = tc.alloc->elem_size;
    const unsigned char* now = tc.alloc->data + tc.elem * es;
    bool changed = std::memcmp(now, tc.old, es < 16 ? es : 16) != 0;
    const uint32_t me = t.tid;
    const uint64_t my_sg_epoch = L.sg_epoch[t.sg];
    auto ordered_by_simd_barrier = [&](int32_t other, uint64_t other_ep) {
      return other >= 0 && L.threads[other].sg == t.sg &&
          other_ep != my_sg_epoch;
    };
    auto elem = [&] {
      return std::string(tc.alloc->name) + "[" + std::to_string(tc.elem) + "]";
    };
    if (sh.write_epoch == L.epoch && sh.writer >= 0 &&
        sh.writer != int32_t(me) &&
        !ordered_by_simd_barrier(sh.writer, sh.writer_sg_epoch)) {
      throw EmuError(
          where() + ": threadgroup memory race on " + elem() + ": thread " +
          std::to_string(me) + (changed ? " wrote" : " read") +
          " it after thread " + std::to_string(sh.writer) +
          " wrote it, with no threadgroup_barrier between (near " +
          site_str(t.site) + ")");
    }
    if (changed && sh.touch_epoch == L.epoch &&
        (sh.multi || (sh.toucher >= 0 && sh.toucher != int32_t(me)))) {
      int32_t other = sh.toucher != int32_t(me) ? sh.toucher : -1;
      throw EmuError(
          where() + ": threadgroup memory race on " + elem() + ": thread " +
          std::to_string(me) + " wrote it after " +
          (other >= 0 ? "thread " + std::to_string(other)
                      : std::string("other threads")) +
          " accessed it, with no threadgroup_barrier between (near " +
          site_str(t.site) + ")");
    }
    if (!changed && !sh.init) {
      throw EmuError(
          where() + ": read of uninitialised threadgroup memory " + elem() +
          " (near " + site_str(t.site) + ")");
    }
    if (changed) {
      sh.init = true;
      sh.writer = int32_t(me);
      sh.write_epoch = L.epoch;
      sh.writer_sg_epoch = my_sg_epoch;
    }
    if (sh.touch_epoch != L.epoch) {
      sh.touch_epoch = L.epoch;
      sh.toucher = int32_t(me);
      sh.multi = false;
    } else if (sh.toucher != int32_t(me)) {
      sh.multi = true;
    }
  }
  t.touches.clear();
}

bool site_less(const Site& a, const Site& b) {
  int c = std::strcmp(a.file ? a.file : "", b.file ? b.file : "");
  if (c != 0) {
    return c < 0;
  }
  if (a.line != b.line) {
    return a.line < b.line;
  }
  return a.column < b.column;
}

bool site_eq(const Site& a, const Site& b) {
  return !site_less(a, b) && !site_less(b, a);
}

// Resolves the pending simd call of each simdgroup whose live lanes are all
// blocked. Lanes waiting at the same call are the active lanes; where lanes
// wait at different calls (divergence), the earliest call in source order
// goes first. Returns whether any lanes were released.
bool resolve_simd() {
  Launch& L = *g_launch;
  bool released = false;
  const int nsg = (L.nthreads + kSimdWidth - 1) / kSimdWidth;
  for (int g = 0; g < nsg; ++g) {
    int lo = g * kSimdWidth;
    int hi = std::min(L.nthreads, lo + kSimdWidth);
    Thread* pick = nullptr;
    bool blocked = true;
    for (int i = lo; i < hi; ++i) {
      Thread& t = L.threads[i];
      if (t.state == State::runnable) {
        blocked = false;
      }
      if (t.state == State::at_simd &&
          (pick == nullptr || site_less(t.site, pick->site))) {
        pick = &t;
      }
    }
    if (!blocked || pick == nullptr) {
      continue;
    }
    SimdSlot* lanes[kSimdWidth] = {};
    uint32_t active = 0;
    std::vector<Thread*> members;
    for (int i = lo; i < hi; ++i) {
      Thread& t = L.threads[i];
      if (t.state == State::at_simd && site_eq(t.site, pick->site)) {
        if (t.resolver != pick->resolver || t.simd_barrier != pick->simd_barrier) {
          L.current = &t;
          throw EmuError(
              where() + ": lanes of simdgroup " + std::to_string(g) +
              " wait at " + site_str(t.site) + " in different simd functions (" +
              (t.op ? t.op : "?") + " vs " + (pick->op ? pick->op : "?") + ")");
        }
        lanes[t.lane] = &t.slot;
        active |= 1u << t.lane;
        members.push_back(&t);
      }
    }
    L.current = pick;
    if (pick->simd_barrier) {
      if (pick->flags & unsigned(metal::mem_flags::mem_threadgroup)) {
        L.sg_epoch[g]++;
      }
    } else {
      pick->resolver(lanes, active);
    }
    for (Thread* t : members) {
      t->state = State::runnable;
    }
    released = true;
  }
  return released;
}

// All live threads wait at a barrier: check that it is the same one and
// that no thread exited without reaching it, then release them.
void resolve_barrier() {
  Launch& L = *g_launch;
  std::vector<uint32_t> waiting, exited;
  Thread* first = nullptr;
  for (auto& t : L.threads) {
    if (t.state == State::at_barrier) {
      waiting.push_back(t.tid);
      if (!first) {
        first = &t;
      }
    } else if (t.state == State::done) {
      exited.push_back(t.tid);
    }
  }
  if (!first) {
    return;
  }
  L.current = nullptr;
  if (!exited.empty()) {
    throw EmuError(
        where() + ": deadlock: threads " + id_list(waiting) +
        " wait at threadgroup_barrier (" + site_str(first->site) +
        ") that threads " + id_list(exited) + " exited without reaching");
  }
  for (auto& t : L.threads) {
    if (!site_eq(t.site, first->site)) {
      throw EmuError(
          where() + ": threads wait at different threadgroup barriers: " +
          "thread " + std::to_string(first->tid) + " at " +
          site_str(first->site) + ", thread " + std::to_string(t.tid) +
          " at " + site_str(t.site) + " (a deadlock on the GPU)");
    }
  }
  if (first->flags & unsigned(metal::mem_flags::mem_threadgroup)) {
    L.epoch++;
  }
  for (auto& t : L.threads) {
    t.state = State::runnable;
  }
}

void run_group() {
  Launch& L = *g_launch;
  L.allocs.clear();
  L.param_allocs.clear();
  L.tg_bytes = 0;
  L.epoch = 1;
  L.sg_epoch.assign((L.nthreads + kSimdWidth - 1) / kSimdWidth, 0);
  for (int i = 0; i < L.nthreads; ++i) {
    Thread& t = L.threads[i];
    t.tid = uint32_t(i);
    t.lane = uint32_t(i % kSimdWidth);
    t.sg = uint32_t(i / kSimdWidth);
    t.local[0] = uint32_t(i) % L.tg[0];
    t.local[1] = (uint32_t(i) / L.tg[0]) % L.tg[1];
    t.local[2] = uint32_t(i) / (L.tg[0] * L.tg[1]);
    t.state = State::runnable;
    t.touches.clear();
    t.stack = stack_for(size_t(i));
#ifdef MEMU_ASM_SWITCH
    // Initial frame popped by memu_switch: r15, r14, r13 (entry), r12 (its
    // argument), rbx, rbp, then "return" into the trampoline with rsp
    // 16-byte aligned.
    auto* top = reinterpret_cast<void**>(t.stack + kStackSize - 16);
    void** frame = top - 7;
    frame[0] = nullptr;
    frame[1] = nullptr;
    frame[2] = reinterpret_cast<void*>(&fiber_entry);
    frame[3] = reinterpret_cast<void*>(long(i));
    frame[4] = nullptr;
    frame[5] = nullptr;
    frame[6] = reinterpret_cast<void*>(&memu_trampoline);
    t.sp = frame;
#else
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack + 4096;
    t.ctx.uc_stack.ss_size = kStackSize - 4096;
    t.ctx.uc_link = &L.sched;
    makecontext(&t.ctx, reinterpret_cast<void (*)()>(fiber_main), 1, i);
#endif
  }
  while (true) {
    bool any_alive = false;
    for (auto& t : L.threads) {
      if (t.state != State::runnable) {
        any_alive |= t.state != State::done;
        continue;
      }
      L.current = &t;
      L.segment++;
#ifdef MEMU_ASM_SWITCH
      memu_switch(&L.sched_sp, t.sp);
#else
      swapcontext(&L.sched, &t.ctx);
#endif
      if (!L.error.empty()) {
        return;
      }
      check_segment(t);
      any_alive |= t.state != State::done;
    }
    L.current = nullptr;
    if (!any_alive) {
      return;
    }
    if (resolve_simd()) {
      continue;
    }
    resolve_barrier();
  }
}

} // namespace

// ---------------------------------------------------------------------------
// Interface used by the shim.

void register_kernel(KernelInfo info) {
  auto name = info.name;
  if (registry().count(name)) {
    std::fprintf(
        stderr, "metal emulator: kernel %s registered twice\n", name.c_str());
    std::abort();
  }
  registry().emplace(name, std::move(info));
}

std::string binding_error(const Binding& b, const char* expected) {
  return "parameter '" + std::string(b.name) + "' needs " + expected;
}

void rt_fail(const std::string& what) {
  throw EmuError(where() + ": " + what);
}

SimdSlot& rt_simd_slot() {
  return g_launch->current->slot;
}

void rt_simd_wait(const char* op, SimdResolver resolve, Site site) {
  Thread& t = *g_launch->current;
  t.op = op;
  t.resolver = resolve;
  t.simd_barrier = false;
  t.site = site;
  t.state = State::at_simd;
  yield_to_scheduler();
}

void rt_barrier(bool simdgroup_scope, unsigned flags, Site site) {
  Thread& t = *g_launch->current;
  t.site = site;
  t.flags = flags;
  if (simdgroup_scope) {
    t.op = "simdgroup_barrier";
    t.resolver = nullptr;
    t.simd_barrier = true;
    t.state = State::at_simd;
  } else {
    t.op = "threadgroup_barrier";
    t.state = State::at_barrier;
  }
  yield_to_scheduler();
}

const BufferInfo* rt_buffer(int index) {
  auto& b = g_launch->buffers;
  if (index < 0 || size_t(index) >= b.size() || b[index].data == nullptr) {
    return nullptr;
  }
  return &b[index];
}

void rt_device_oob(
    const BufferInfo* buf,
    int64_t offset,
    size_t size,
    size_t align,
    const char* type) {
  std::string t = type;
  auto p = t.find("T = ");
  if (p != std::string::npos) {
    t = t.substr(p + 4);
    t = t.substr(0, t.find_first_of("];"));
  }
  if (buf == nullptr) {
    rt_fail("access through a device pointer whose buffer is not bound");
  }
  std::ostringstream os;
  bool misaligned = offset >= 0 && uint64_t(offset) + size <= buf->size;
  os << (misaligned ? "misaligned" : "out-of-bounds") << " access to buffer("
     << buf->index << ") of " << buf->size << " bytes at byte offset "
     << offset << " (" << size << "-byte " << t << ", alignment " << align
     << ")";
  rt_fail(os.str());
}

TgAlloc* rt_tg_alloc(
    const void* key,
    const char* name,
    size_t elem_size,
    size_t count) {
  Launch& L = *g_launch;
  auto it = L.allocs.find(key);
  if (it != L.allocs.end()) {
    return &it->second.a;
  }
  size_t bytes = elem_size * count;
  L.tg_bytes += bytes;
  if (L.tg_bytes > kMaxThreadgroupMemory) {
    rt_fail(
        "threadgroup memory exceeds 32 KiB (" + std::to_string(L.tg_bytes) +
        " bytes) at " + name);
  }
  Alloc& al = L.allocs[key];
  al.storage.assign(bytes, kTgPoison);
  al.shadow.assign(count, Shadow{});
  al.a = TgAlloc{al.storage.data(), elem_size, count, name};
  return &al.a;
}

TgAlloc* rt_tg_param(int index, size_t elem_size) {
  Launch& L = *g_launch;
  auto it = L.param_allocs.find(index);
  if (it != L.param_allocs.end()) {
    return &it->second.a;
  }
  if (index < 0 || size_t(index) >= L.tg_param_lengths.size() ||
      L.tg_param_lengths[index] == 0) {
    rt_fail("threadgroup(" + std::to_string(index) + ") has no length set");
  }
  size_t bytes = L.tg_param_lengths[index];
  L.tg_bytes += bytes;
  if (L.tg_bytes > kMaxThreadgroupMemory) {
    rt_fail("threadgroup memory exceeds 32 KiB");
  }
  Alloc& al = L.param_allocs[index];
  al.storage.assign(bytes, kTgPoison);
  al.shadow.assign(bytes / elem_size, Shadow{});
  static const char* names[] = {"threadgroup(0)", "threadgroup(1)",
                                "threadgroup(2)", "threadgroup(3)"};
  al.a = TgAlloc{
      al.storage.data(), elem_size, bytes / elem_size,
      index < 4 ? names[index] : "threadgroup(n)"};
  return &al.a;
}

void rt_tg_bounds(TgAlloc* a, int64_t byte_offset, size_t size) {
  const int64_t total = int64_t(a->elem_size * a->count);
  if (byte_offset < 0 || byte_offset + int64_t(size) > total) {
    rt_fail(
        "out-of-bounds threadgroup memory access to " + std::string(a->name) +
        " at byte offset " + std::to_string(byte_offset) + " (" +
        std::to_string(total) + " bytes)");
  }
}

void rt_tg_touch(TgAlloc* a, int64_t byte_offset, size_t size) {
  Launch& L = *g_launch;
  rt_tg_bounds(a, byte_offset, size);
  Alloc* al = reinterpret_cast<Alloc*>(a);
  Thread& t = *L.current;
  size_t e0 = size_t(byte_offset) / a->elem_size;
  size_t e1 = size_t(byte_offset + int64_t(size) - 1) / a->elem_size;
  for (size_t e = e0; e <= e1; ++e) {
    Shadow& sh = al->shadow[e];
    if (sh.seg == L.segment) {
      continue; // already recorded in this segment, with its old value
    }
    sh.seg = L.segment;
    Touch tc{a, e, {}};
    std::memcpy(
        tc.old, a->data + e * a->elem_size, std::min<size_t>(a->elem_size, 16));
    t.touches.push_back(tc);
  }
}

void rt_attr(int attr, uint32_t out[3]) {
  Launch& L = *g_launch;
  Thread& t = *L.current;
  for (int i = 0; i < 3; ++i) {
    uint32_t v = 0;
    switch (Attr(attr)) {
      case Attr::thread_position_in_grid:
        v = L.group[i] * L.tg[i] + t.local[i];
        break;
      case Attr::threadgroup_position_in_grid:
        v = L.group[i];
        break;
      case Attr::thread_position_in_threadgroup:
        v = t.local[i];
        break;
      case Attr::thread_index_in_threadgroup:
        v = i == 0 ? t.tid : 0;
        break;
      case Attr::threads_per_threadgroup:
        v = L.tg[i];
        break;
      case Attr::threadgroups_per_grid:
        v = L.grid[i];
        break;
      case Attr::threads_per_grid:
        v = L.grid[i] * L.tg[i];
        break;
      case Attr::thread_index_in_simdgroup:
        v = i == 0 ? t.lane : 0;
        break;
      case Attr::simdgroup_index_in_threadgroup:
        v = i == 0 ? t.sg : 0;
        break;
      case Attr::simdgroups_per_threadgroup:
        v = i == 0 ? uint32_t((L.nthreads + kSimdWidth - 1) / kSimdWidth) : 0;
        break;
      case Attr::threads_per_simdgroup:
      case Attr::thread_execution_width:
        v = i == 0 ? kSimdWidth : 0;
        break;
    }
    out[i] = v;
  }
}

void check_uniform_arg(SimdSlot* const* lanes, uint32_t active, const char* op) {
  int first = -1;
  for (int i = 0; i < kSimdWidth; ++i) {
    if (active >> i & 1u) {
      if (first < 0) {
        first = lanes[i]->arg;
      } else if (lanes[i]->arg != first) {
        rt_fail(
            std::string(op) + ": the lane/offset argument differs across " +
            "lanes (" + std::to_string(first) + " vs " +
            std::to_string(lanes[i]->arg) + "); Metal requires it uniform");
      }
    }
  }
}

void resolve_ballot(SimdSlot* const* lanes, uint32_t active) {
  uint64_t mask = 0;
  for (int i = 0; i < kSimdWidth; ++i) {
    if ((active >> i & 1u) && slot_in<bool>(lanes[i])) {
      mask |= uint64_t(1) << i;
    }
  }
  for (int i = 0; i < kSimdWidth; ++i) {
    if (active >> i & 1u) {
      slot_out(lanes[i], mask);
    }
  }
}

} // namespace metal_emu

// ---------------------------------------------------------------------------
// C interface for the Python harness.

using namespace metal_emu;

namespace {

void copy_error(const std::string& msg, char* err, int err_len) {
  if (err && err_len > 0) {
    std::snprintf(err, size_t(err_len), "%s", msg.c_str());
  }
}

// Kills the process if a launch runs past its time-out: a thread spinning
// without reaching a barrier or simd function cannot be preempted.
struct Watchdog {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread th;
  Watchdog(double seconds, std::string name) {
    th = std::thread([this, seconds, name]() {
      std::unique_lock<std::mutex> lk(m);
      if (!cv.wait_for(
              lk, std::chrono::duration<double>(seconds), [this] {
                return done;
              })) {
        std::fprintf(
            stderr,
            "metal emulator: kernel %s did not finish within %.0f s "
            "(a runaway loop?); aborting\n",
            name.c_str(),
            seconds);
        std::fflush(stderr);
        std::abort();
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lk(m);
      done = true;
    }
    cv.notify_all();
    th.join();
  }
};

} // namespace

extern "C" {

// Newline-separated names of all registered kernels; returns the length
// needed.
int memu_kernel_names(char* out, int len) {
  std::string s;
  for (auto& [name, info] : registry()) {
    s += name + "\n";
  }
  copy_error(s, out, len);
  return int(s.size()) + 1;
}

// Runs `name` over grid[0..2] threadgroups of tg[0..2] threads (as Metal's
// dispatchThreadgroups). Buffer slot i is ptrs[i] (null: unbound) of
// sizes[i] bytes. Returns 0, or 1 with a message in err.
int memu_launch(
    const char* name,
    const uint32_t* grid,
    const uint32_t* tg,
    int n_buffers,
    void* const* ptrs,
    const uint64_t* sizes,
    int n_tg_params,
    const uint64_t* tg_param_lengths,
    double timeout_s,
    char* err,
    int err_len) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  auto it = registry().find(name);
  if (it == registry().end()) {
    copy_error(std::string("no kernel named ") + name, err, err_len);
    return 1;
  }
  Launch L;
  L.kernel = &it->second;
  uint64_t n = 1;
  for (int i = 0; i < 3; ++i) {
    L.grid[i] = grid[i];
    L.tg[i] = tg[i];
    n *= tg[i];
  }
  if (n == 0 || n > uint64_t(kMaxThreads)) {
    copy_error(
        "threadgroup of " + std::to_string(n) + " threads: must be 1..1024",
        err,
        err_len);
    return 1;
  }
  L.nthreads = int(n);
  for (int i = 0; i < n_buffers; ++i) {
    L.buffers.push_back(
        BufferInfo{static_cast<unsigned char*>(ptrs[i]), sizes[i], i});
  }
  L.tg_param_lengths.assign(tg_param_lengths, tg_param_lengths + n_tg_params);
  L.threads.resize(L.nthreads);
  g_launch = &L;
  Watchdog dog(timeout_s, name);
  try {
    for (uint32_t z = 0; z < L.grid[2] && L.error.empty(); ++z) {
      for (uint32_t y = 0; y < L.grid[1] && L.error.empty(); ++y) {
        for (uint32_t x = 0; x < L.grid[0] && L.error.empty(); ++x) {
          L.group[0] = x;
          L.group[1] = y;
          L.group[2] = z;
          run_group();
        }
      }
    }
  } catch (const std::exception& e) {
    if (L.error.empty()) {
      L.error = e.what();
    }
  }
  g_launch = nullptr;
  if (!L.error.empty()) {
    copy_error(L.error, err, err_len);
    return 1;
  }
  return 0;
}

} // extern "C"
