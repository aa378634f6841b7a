// Metal shim: lets clang++ compile the kernels in metal/ as C++ and lets the
// threadgroup emulator execute them.
//
// metal2cpp.py first rewrites the address spaces of the (preprocessed) Metal
// source into the classes below:
//   device T* / constant T*   -> metal_emu::device_ptr<T> (bounds-checked)
//   constant T&               -> metal_emu::cref<T>
//   threadgroup T* / arrays   -> metal_emu::tg_ptr<T> / tg_array<T, N>
//                                (shared per threadgroup, race-checked)
//   thread                    -> (plain C++)
// and strips Metal attributes after recording the kernel parameter bindings.
// Everything a kernel calls (vector types, half/bfloat, as_type, math, simd
// and barrier functions) is declared here; simd functions and barriers hand
// over to the emulator runtime (emu_runtime.cpp), which runs the threads of
// a threadgroup as fibers.
#pragma once

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace metal_emu {

// ---------------------------------------------------------------------------
// Runtime interface (implemented in emu_runtime.cpp).

struct Site {
  const char* file;
  int line;
  int column;
};

// Call-site capture for simd functions and barriers: the emulator groups the
// lanes of a simdgroup by the source location they wait at.
#define MEMU_SITE_PARAMS                                               \
  const char *memu_file = __builtin_FILE(), int memu_line = __builtin_LINE(), \
             int memu_col = __builtin_COLUMN()
#define MEMU_SITE \
  ::metal_emu::Site { memu_file, memu_line, memu_col }

// Bytes a lane hands to a simd function and gets back.
struct SimdSlot {
  alignas(16) unsigned char in[64];
  alignas(16) unsigned char out[64];
  int arg;
};
// Computes every active lane's result; lanes[i] is null for inactive lanes.
using SimdResolver = void (*)(SimdSlot* const* lanes, uint32_t active);

struct BufferInfo {
  unsigned char* data;
  uint64_t size;
  int index;
};

struct TgAlloc {
  unsigned char* data;
  size_t elem_size;
  size_t count;
  const char* name;
};

enum class Attr : int {
  thread_position_in_grid,
  threadgroup_position_in_grid,
  thread_position_in_threadgroup,
  thread_index_in_threadgroup,
  threads_per_threadgroup,
  threadgroups_per_grid,
  threads_per_grid,
  thread_index_in_simdgroup,
  simdgroup_index_in_threadgroup,
  simdgroups_per_threadgroup,
  threads_per_simdgroup,
  thread_execution_width,
};

struct Binding {
  enum Kind : int { buffer, threadgroup, attribute } kind;
  int index; // buffer / threadgroup slot, or an Attr
  const char* name; // parameter name, for messages
};

[[noreturn]] void rt_fail(const std::string& what);
SimdSlot& rt_simd_slot();
void rt_simd_wait(const char* op, SimdResolver resolve, Site site);
void rt_barrier(bool simdgroup_scope, unsigned flags, Site site);
const BufferInfo* rt_buffer(int index);
[[noreturn]] void rt_device_oob(
    const BufferInfo* buf,
    int64_t offset,
    size_t size,
    size_t align,
    const char* type);
TgAlloc* rt_tg_alloc(
    const void* key,
    const char* name,
    size_t elem_size,
    size_t count);
TgAlloc* rt_tg_param(int index, size_t elem_size);
void rt_tg_touch(TgAlloc* a, int64_t byte_offset, size_t size);
void rt_tg_bounds(TgAlloc* a, int64_t byte_offset, size_t size);
void rt_attr(int attr, uint32_t out[3]);

// ---------------------------------------------------------------------------
// Scalar types.

struct half_t;
struct bfloat_t;

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 with round-to-nearest-even conversions.
struct half_t {
  uint16_t bits;
  half_t() = default;
  half_t(float f) : bits(from_float(f)) {}
  half_t(double f) : bits(from_float(float(f))) {}
  half_t(int i) : bits(from_float(float(i))) {}
  half_t(unsigned i) : bits(from_float(float(i))) {}
  operator float() const {
    return to_float(bits);
  }
  static uint16_t from_float(float f) {
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) {
      return uint16_t(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    }
    if (ax >= 0x477FF000u) { // rounds to >= 65520: overflow
      return uint16_t(sign | 0x7C00u);
    }
    if (ax < 0x38800000u) { // subnormal or zero in half
      float a = f32_from(ax) * 16777216.0f; // scale by 2^24, rint -> RNE
      return uint16_t(sign | uint32_t(std::nearbyint(a)));
    }
    uint32_t mant_odd = (ax >> 13) & 1u;
    ax += 0xC8000FFFu + mant_odd; // rebias exponent and round to even
    return uint16_t(sign | (ax >> 13));
  }
  static float to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;
    if (e == 0) {
      float v = float(m) * (1.0f / 16777216.0f);
      return sign ? -v : v;
    }
    if (e == 31) {
      return f32_from(sign | 0x7F800000u | (m << 13));
    }
    return f32_from(sign | ((e + 112u) << 23) | (m << 13));
  }
};

// bfloat16: the top half of a float32, round-to-nearest-even.
struct bfloat_t {
  uint16_t bits;
  bfloat_t() = default;
  bfloat_t(float f) : bits(from_float(f)) {}
  bfloat_t(double f) : bits(from_float(float(f))) {}
  bfloat_t(int i) : bits(from_float(float(i))) {}
  operator float() const {
    return f32_from(uint32_t(bits) << 16);
  }
  static uint16_t from_float(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
      return uint16_t((x >> 16) | 0x40u);
    }
    x += 0x7FFFu + ((x >> 16) & 1u);
    return uint16_t(x >> 16);
  }
};

// ---------------------------------------------------------------------------
// Vector types (Metal layout: 3-component vectors take the size of 4).

template <class T, int N>
struct vec;

template <class T>
struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  template <class U>
  explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  T& operator[](int i) {
    return (&x)[i];
  }
  const T& operator[](int i) const {
    return (&x)[i];
  }
};

template <class T>
struct alignas(4 * sizeof(T)) vec<T, 3> {
  T x, y, z;
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  template <class U>
  explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  T& operator[](int i) {
    return (&x)[i];
  }
  const T& operator[](int i) const {
    return (&x)[i];
  }
};

template <class T>
struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <class U>
  explicit vec(const vec<U, 4>& o)
      : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  T& operator[](int i) {
    return (&x)[i];
  }
  const T& operator[](int i) const {
    return (&x)[i];
  }
};

template <class T>
struct is_vec : std::false_type {};
template <class T, int N>
struct is_vec<vec<T, N>> : std::true_type {};

#define MEMU_VEC_BINOP(op)                                              \
  template <class T, int N>                                             \
  vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {       \
    vec<T, N> r;                                                        \
    for (int i = 0; i < N; ++i)                                         \
      r[i] = T(a[i] op b[i]);                                           \
    return r;                                                           \
  }                                                                     \
  template <class T, int N, class S,                                    \
            std::enable_if_t<std::is_arithmetic_v<S>, int> = 0>         \
  vec<T, N> operator op(const vec<T, N>& a, S b) {                      \
    return a op vec<T, N>(T(b));                                        \
  }                                                                     \
  template <class T, int N, class S,                                    \
            std::enable_if_t<std::is_arithmetic_v<S>, int> = 0>         \
  vec<T, N> operator op(S a, const vec<T, N>& b) {                      \
    return vec<T, N>(T(a)) op b;                                        \
  }                                                                     \
  template <class T, int N>                                             \
  vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) {         \
    return a = a op b;                                                  \
  }
MEMU_VEC_BINOP(+)
MEMU_VEC_BINOP(-)
MEMU_VEC_BINOP(*)
MEMU_VEC_BINOP(/)
MEMU_VEC_BINOP(&)
MEMU_VEC_BINOP(|)
MEMU_VEC_BINOP(^)
#undef MEMU_VEC_BINOP

#define MEMU_VEC_CMP(op)                                                \
  template <class T, int N>                                             \
  vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {    \
    vec<bool, N> r;                                                     \
    for (int i = 0; i < N; ++i)                                         \
      r[i] = a[i] op b[i];                                              \
    return r;                                                           \
  }
MEMU_VEC_CMP(==)
MEMU_VEC_CMP(!=)
MEMU_VEC_CMP(<)
MEMU_VEC_CMP(<=)
MEMU_VEC_CMP(>)
MEMU_VEC_CMP(>=)
#undef MEMU_VEC_CMP

// ---------------------------------------------------------------------------
// Atomics: threads of a threadgroup run as fibers on one OS thread, so plain
// read-modify-write is atomic. Atomic objects are exempt from race tracking.

template <class T>
struct atomic_t {
  T value;
};
template <class T>
struct is_atomic : std::false_type {};
template <class T>
struct is_atomic<atomic_t<T>> : std::true_type {};

// ---------------------------------------------------------------------------
// Address spaces.

// A pointer into a device (or constant) buffer bound by the launcher. Every
// dereference is checked against the buffer's size and the type's alignment.
template <class T>
class device_ptr {
 public:
  using element_type = T;
  device_ptr() = default;
  device_ptr(std::nullptr_t) {}
  device_ptr(const BufferInfo* buf, int64_t byte_offset)
      : buf_(buf), off_(byte_offset) {}
  // Adding const (device T* -> device const T*) is implicit, as in Metal.
  template <
      class U,
      std::enable_if_t<std::is_convertible_v<U*, T*>, int> = 0>
  device_ptr(const device_ptr<U>& o) : buf_(o.buffer()), off_(o.offset()) {}
  // Any other pointer type change needs a cast, as in Metal.
  template <
      class U,
      std::enable_if_t<!std::is_convertible_v<U*, T*>, int> = 0>
  explicit device_ptr(const device_ptr<U>& o)
      : buf_(o.buffer()), off_(o.offset()) {}

  T& operator*() const {
    return *at(0);
  }
  T* operator->() const {
    return at(0);
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  T& operator[](I i) const {
    return *at(to_i64(i));
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  device_ptr operator+(I i) const {
    return device_ptr(buf_, off_ + to_i64(i) * int64_t(sizeof(T)));
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  friend device_ptr operator+(I i, const device_ptr& p) {
    return p + i;
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  device_ptr operator-(I i) const {
    return device_ptr(buf_, off_ - to_i64(i) * int64_t(sizeof(T)));
  }
  int64_t operator-(const device_ptr& o) const {
    return (off_ - o.off_) / int64_t(sizeof(T));
  }
  template <class I>
  device_ptr& operator+=(I i) {
    return *this = *this + i;
  }
  template <class I>
  device_ptr& operator-=(I i) {
    return *this = *this - i;
  }
  device_ptr& operator++() {
    return *this = *this + 1;
  }
  device_ptr& operator--() {
    return *this = *this - 1;
  }
  device_ptr operator++(int) {
    device_ptr p = *this;
    ++*this;
    return p;
  }
  bool operator==(const device_ptr& o) const {
    return buf_ == o.buf_ && off_ == o.off_;
  }
  bool operator!=(const device_ptr& o) const {
    return !(*this == o);
  }
  bool operator<(const device_ptr& o) const {
    return off_ < o.off_;
  }
  explicit operator bool() const {
    return buf_ != nullptr;
  }

  const BufferInfo* buffer() const {
    return buf_;
  }
  int64_t offset() const {
    return off_;
  }

 private:
  template <class I>
  static int64_t to_i64(I i) {
    if constexpr (std::is_unsigned_v<I> && sizeof(I) == 8) {
      // A huge unsigned index is out of bounds; keep it out of bounds.
      return i > uint64_t(INT64_MAX) ? INT64_MIN / 2 : int64_t(i);
    } else {
      return int64_t(i);
    }
  }
  T* at(int64_t i) const {
    int64_t o = off_ + i * int64_t(sizeof(T));
    if (buf_ == nullptr || o < 0 ||
        uint64_t(o) + sizeof(T) > buf_->size ||
        (reinterpret_cast<uintptr_t>(buf_->data) + uint64_t(o)) %
                alignof(T) !=
            0) {
      rt_device_oob(buf_, o, sizeof(T), alignof(T), type_name());
    }
    return reinterpret_cast<T*>(buf_->data + o);
  }
  static const char* type_name() {
    return __PRETTY_FUNCTION__;
  }

  const BufferInfo* buf_ = nullptr;
  int64_t off_ = 0;
};

template <class T>
using constant_ptr = device_ptr<const T>;
template <class T>
using cref = const T&;

// A pointer into threadgroup memory. Each access is reported to the
// runtime, which checks bounds and races between barriers.
template <class T>
class tg_ptr {
 public:
  using element_type = T;
  tg_ptr() = default;
  tg_ptr(std::nullptr_t) {}
  tg_ptr(TgAlloc* a, int64_t byte_offset) : a_(a), off_(byte_offset) {}
  template <
      class U,
      std::enable_if_t<std::is_convertible_v<U*, T*>, int> = 0>
  tg_ptr(const tg_ptr<U>& o) : a_(o.alloc()), off_(o.offset()) {}
  template <
      class U,
      std::enable_if_t<!std::is_convertible_v<U*, T*>, int> = 0>
  explicit tg_ptr(const tg_ptr<U>& o) : a_(o.alloc()), off_(o.offset()) {}

  T& operator*() const {
    return *at(0);
  }
  T* operator->() const {
    return at(0);
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  T& operator[](I i) const {
    return *at(int64_t(i));
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  tg_ptr operator+(I i) const {
    return tg_ptr(a_, off_ + int64_t(i) * int64_t(sizeof(T)));
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  tg_ptr operator-(I i) const {
    return tg_ptr(a_, off_ - int64_t(i) * int64_t(sizeof(T)));
  }
  int64_t operator-(const tg_ptr& o) const {
    return (off_ - o.off_) / int64_t(sizeof(T));
  }
  template <class I>
  tg_ptr& operator+=(I i) {
    return *this = *this + i;
  }
  bool operator==(const tg_ptr& o) const {
    return a_ == o.a_ && off_ == o.off_;
  }
  bool operator!=(const tg_ptr& o) const {
    return !(*this == o);
  }

  TgAlloc* alloc() const {
    return a_;
  }
  int64_t offset() const {
    return off_;
  }

 private:
  T* at(int64_t i) const {
    int64_t o = off_ + i * int64_t(sizeof(T));
    if (a_ == nullptr) {
      rt_fail("dereference of a null threadgroup pointer");
    }
    if constexpr (is_atomic<std::remove_cv_t<T>>::value) {
      rt_tg_bounds(a_, o, sizeof(T));
    } else {
      rt_tg_touch(a_, o, sizeof(T));
    }
    return reinterpret_cast<T*>(a_->data + o);
  }

  TgAlloc* a_ = nullptr;
  int64_t off_ = 0;
};

// `threadgroup T name[N];` inside a kernel: one allocation per threadgroup,
// shared by all its threads (the declaration site's static object is the
// key, so each template instantiation gets its own).
template <class T, size_t N>
class tg_array {
 public:
  explicit tg_array(TgAlloc* a) : a_(a) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  T& operator[](I i) const {
    return tg_ptr<T>(a_, 0)[i];
  }
  operator tg_ptr<T>() const {
    return tg_ptr<T>(a_, 0);
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  tg_ptr<T> operator+(I i) const {
    return tg_ptr<T>(a_, 0) + i;
  }

 private:
  TgAlloc* a_;
};

template <class T, size_t N>
class tg_decl {
 public:
  explicit tg_decl(const char* name) : name_(name) {}
  tg_array<T, N> get() const {
    return tg_array<T, N>(rt_tg_alloc(this, name_, sizeof(T), N));
  }

 private:
  const char* name_;
};

// ---------------------------------------------------------------------------
// Simd-group function resolvers (run by the scheduler once every active lane
// of a simdgroup has posted its value).

template <class T>
T slot_in(const SimdSlot* s) {
  T v;
  std::memcpy(&v, s->in, sizeof(T));
  return v;
}
template <class T>
void slot_out(SimdSlot* s, const T& v) {
  std::memcpy(s->out, &v, sizeof(T));
}

// An inactive source lane yields garbage, as on the GPU.
template <class T>
void slot_poison(SimdSlot* s) {
  std::memset(s->out, 0xA5, sizeof(T));
}

template <class T, class Op>
void resolve_reduce(SimdSlot* const* lanes, uint32_t active) {
  T acc{};
  bool first = true;
  for (int i = 0; i < 32; ++i) {
    if (active >> i & 1u) {
      T v = slot_in<T>(lanes[i]);
      acc = first ? v : Op{}(acc, v);
      first = false;
    }
  }
  for (int i = 0; i < 32; ++i) {
    if (active >> i & 1u) {
      slot_out(lanes[i], acc);
    }
  }
}

template <class T, class Op, bool Inclusive>
void resolve_prefix(SimdSlot* const* lanes, uint32_t active) {
  T acc = Op::template identity<T>();
  for (int i = 0; i < 32; ++i) {
    if (active >> i & 1u) {
      T v = slot_in<T>(lanes[i]);
      T next = Op{}(acc, v);
      slot_out(lanes[i], Inclusive ? next : acc);
      acc = next;
    }
  }
}

enum class Shuffle {
  index,
  down,
  up,
  xor_,
  rotate_down,
  rotate_up,
  broadcast,
  broadcast_first
};

void check_uniform_arg(SimdSlot* const* lanes, uint32_t active, const char* op);

template <class T, Shuffle K>
void resolve_shuffle(SimdSlot* const* lanes, uint32_t active) {
  constexpr bool uniform = K != Shuffle::index;
  if (uniform && K != Shuffle::broadcast_first) {
    check_uniform_arg(lanes, active, "simd shuffle/broadcast");
  }
  int first = -1;
  for (int i = 0; i < 32 && first < 0; ++i) {
    if (active >> i & 1u) {
      first = i;
    }
  }
  for (int i = 0; i < 32; ++i) {
    if (!(active >> i & 1u)) {
      continue;
    }
    int a = lanes[i]->arg;
    int src = 0;
    bool keep_own = false;
    switch (K) {
      case Shuffle::index:
      case Shuffle::broadcast:
        src = a;
        break;
      case Shuffle::down:
        src = i + a;
        keep_own = src >= 32; // upper lanes are left unchanged
        break;
      case Shuffle::up:
        src = i - a;
        keep_own = src < 0; // lower lanes are left unchanged
        break;
      case Shuffle::xor_:
        src = i ^ a;
        break;
      case Shuffle::rotate_down:
        src = (i + a) & 31;
        break;
      case Shuffle::rotate_up:
        src = (i - a) & 31;
        break;
      case Shuffle::broadcast_first:
        src = first;
        break;
    }
    if (keep_own) {
      src = i;
    }
    if (src < 0 || src >= 32 || !(active >> src & 1u)) {
      slot_poison<T>(lanes[i]);
    } else {
      slot_out(lanes[i], slot_in<T>(lanes[src]));
    }
  }
}

void resolve_ballot(SimdSlot* const* lanes, uint32_t active);

template <class R, class T>
R simd_call(const char* op, SimdResolver res, const T& x, int arg, Site s) {
  static_assert(sizeof(T) <= sizeof(SimdSlot::in), "simd value too large");
  static_assert(std::is_trivially_copyable_v<T>, "simd value not trivial");
  SimdSlot& slot = rt_simd_slot();
  std::memcpy(slot.in, &x, sizeof(T));
  slot.arg = arg;
  rt_simd_wait(op, res, s);
  R r;
  std::memcpy(&r, rt_simd_slot().out, sizeof(R));
  return r;
}

} // namespace metal_emu

// ---------------------------------------------------------------------------
// Metal's global names.

using uint = uint32_t;
using ushort = uint16_t;
using uchar = uint8_t;
using ulong = uint64_t;
using half = metal_emu::half_t;
using atomic_int = metal_emu::atomic_t<int>;
using atomic_uint = metal_emu::atomic_t<uint32_t>;
using atomic_bool = metal_emu::atomic_t<bool>;
using atomic_float = metal_emu::atomic_t<float>;
using bfloat = metal_emu::bfloat_t;
using bfloat16_t = metal_emu::bfloat_t;

#define MEMU_VEC_TYPES(T, name)                 \
  using name##2 = metal_emu::vec<T, 2>;         \
  using name##3 = metal_emu::vec<T, 3>;         \
  using name##4 = metal_emu::vec<T, 4>;
MEMU_VEC_TYPES(float, float)
MEMU_VEC_TYPES(half, half)
MEMU_VEC_TYPES(bfloat, bfloat)
MEMU_VEC_TYPES(int, int)
MEMU_VEC_TYPES(uint, uint)
MEMU_VEC_TYPES(short, short)
MEMU_VEC_TYPES(ushort, ushort)
MEMU_VEC_TYPES(char, char)
MEMU_VEC_TYPES(uchar, uchar)
MEMU_VEC_TYPES(long, long)
MEMU_VEC_TYPES(ulong, ulong)
MEMU_VEC_TYPES(bool, bool)
#undef MEMU_VEC_TYPES

#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif

namespace metal {

using ::bfloat;
using ::half;
using ::uchar;
using ::uint;
using ::ulong;
using ::ushort;

enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
};
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

template <class T, class U>
T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs equal sizes");
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}

template <class T>
using numeric_limits = std::numeric_limits<T>;

// --- math -------------------------------------------------------------------

template <class T>
T min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return std::fmin(a, b);
  } else {
    return b < a ? b : a;
  }
}
template <class T>
T max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return std::fmax(a, b);
  } else {
    return a < b ? b : a;
  }
}
template <class T, int N>
metal_emu::vec<T, N> min(metal_emu::vec<T, N> a, metal_emu::vec<T, N> b) {
  for (int i = 0; i < N; ++i)
    a[i] = min(a[i], b[i]);
  return a;
}
template <class T, int N>
metal_emu::vec<T, N> max(metal_emu::vec<T, N> a, metal_emu::vec<T, N> b) {
  for (int i = 0; i < N; ++i)
    a[i] = max(a[i], b[i]);
  return a;
}
template <class T>
T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T>
T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T>
T abs(T x) {
  return x < T(0) ? T(-x) : x;
}

using std::ceil;
using std::exp;
using std::exp2;
using std::floor;
using std::fma;
using std::log;
using std::log2;
using std::pow;
using std::round;
using std::sqrt;
using std::trunc;
inline float rsqrt(float x) {
  return 1.0f / std::sqrt(x);
}
template <class T>
bool isnan(T x) {
  return std::isnan(float(x));
}
template <class T>
bool isinf(T x) {
  return std::isinf(float(x));
}
template <class T>
bool isfinite(T x) {
  return std::isfinite(float(x));
}
template <class T>
bool signbit(T x) {
  return std::signbit(float(x));
}
inline bool all(bool b) {
  return b;
}
inline bool any(bool b) {
  return b;
}
template <int N>
bool all(metal_emu::vec<bool, N> v) {
  for (int i = 0; i < N; ++i)
    if (!v[i])
      return false;
  return true;
}
template <int N>
bool any(metal_emu::vec<bool, N> v) {
  for (int i = 0; i < N; ++i)
    if (v[i])
      return true;
  return false;
}
namespace fast {
using std::exp;
using std::exp2;
using std::log;
using std::log2;
using std::pow;
using std::sqrt;
using metal::max;
using metal::min;
} // namespace fast
namespace precise {
using std::exp;
using std::exp2;
using std::log;
using std::log2;
using std::pow;
using std::sqrt;
using metal::max;
using metal::min;
} // namespace precise

// --- synchronisation --------------------------------------------------------

inline void threadgroup_barrier(mem_flags f, MEMU_SITE_PARAMS) {
  metal_emu::rt_barrier(false, unsigned(f), MEMU_SITE);
}
inline void simdgroup_barrier(mem_flags f, MEMU_SITE_PARAMS) {
  metal_emu::rt_barrier(true, unsigned(f), MEMU_SITE);
}

// --- atomics -----------------------------------------------------------------

template <class T>
using atomic = metal_emu::atomic_t<T>;

enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst,
};

namespace detail {
template <class T>
metal_emu::atomic_t<T>* atomic_obj(metal_emu::atomic_t<T>* p) {
  if (p == nullptr) {
    metal_emu::rt_fail("atomic operation on a null pointer");
  }
  return p;
}
template <class T>
metal_emu::atomic_t<T>* atomic_obj(const metal_emu::device_ptr<metal_emu::atomic_t<T>>& p) {
  return &*p;
}
template <class T>
metal_emu::atomic_t<T>* atomic_obj(const metal_emu::tg_ptr<metal_emu::atomic_t<T>>& p) {
  return &*p;
}
template <class P>
using atomic_value_t =
    decltype(atomic_obj(std::declval<const P&>())->value);
} // namespace detail

template <class P, class M>
void atomic_store_explicit(P obj, M v, memory_order) {
  detail::atomic_obj(obj)->value = detail::atomic_value_t<P>(v);
}
template <class P>
auto atomic_load_explicit(P obj, memory_order) {
  return detail::atomic_obj(obj)->value;
}
template <class P, class M>
auto atomic_exchange_explicit(P obj, M v, memory_order) {
  auto* a = detail::atomic_obj(obj);
  auto old = a->value;
  a->value = detail::atomic_value_t<P>(v);
  return old;
}
template <class P, class E, class M>
bool atomic_compare_exchange_weak_explicit(
    P obj, E* expected, M desired, memory_order, memory_order) {
  auto* a = detail::atomic_obj(obj);
  if (a->value == *expected) {
    a->value = detail::atomic_value_t<P>(desired);
    return true;
  }
  *expected = a->value;
  return false;
}

#define MEMU_ATOMIC_RMW(fn, expr)                               \
  template <class P, class M>                                   \
  auto fn(P obj, M v, memory_order) {                           \
    auto* a = detail::atomic_obj(obj);                          \
    using V = detail::atomic_value_t<P>;                        \
    V old = a->value;                                           \
    V arg = V(v);                                               \
    a->value = V(expr);                                         \
    return old;                                                 \
  }
MEMU_ATOMIC_RMW(atomic_fetch_add_explicit, old + arg)
MEMU_ATOMIC_RMW(atomic_fetch_sub_explicit, old - arg)
MEMU_ATOMIC_RMW(atomic_fetch_and_explicit, old & arg)
MEMU_ATOMIC_RMW(atomic_fetch_or_explicit, old | arg)
MEMU_ATOMIC_RMW(atomic_fetch_xor_explicit, old ^ arg)
MEMU_ATOMIC_RMW(atomic_fetch_min_explicit, arg < old ? arg : old)
MEMU_ATOMIC_RMW(atomic_fetch_max_explicit, old < arg ? arg : old)
#undef MEMU_ATOMIC_RMW

// --- simd-group functions ---------------------------------------------------

namespace detail {
struct op_sum {
  template <class T>
  T operator()(T a, T b) const {
    return T(a + b);
  }
  template <class T>
  static T identity() {
    return T(0);
  }
};
struct op_product {
  template <class T>
  T operator()(T a, T b) const {
    return T(a * b);
  }
  template <class T>
  static T identity() {
    return T(1);
  }
};
struct op_max {
  template <class T>
  T operator()(T a, T b) const {
    return metal::max(a, b);
  }
};
struct op_min {
  template <class T>
  T operator()(T a, T b) const {
    return metal::min(a, b);
  }
};
struct op_and {
  template <class T>
  T operator()(T a, T b) const {
    return T(a & b);
  }
};
struct op_or {
  template <class T>
  T operator()(T a, T b) const {
    return T(a | b);
  }
};
struct op_xor {
  template <class T>
  T operator()(T a, T b) const {
    return T(a ^ b);
  }
};
} // namespace detail

#define MEMU_SIMD_REDUCE(fn, op)                                            \
  template <class T>                                                        \
  T fn(T x, MEMU_SITE_PARAMS) {                                             \
    return metal_emu::simd_call<T>(                                         \
        #fn, &metal_emu::resolve_reduce<T, detail::op>, x, 0, MEMU_SITE);   \
  }
MEMU_SIMD_REDUCE(simd_sum, op_sum)
MEMU_SIMD_REDUCE(simd_product, op_product)
MEMU_SIMD_REDUCE(simd_max, op_max)
MEMU_SIMD_REDUCE(simd_min, op_min)
MEMU_SIMD_REDUCE(simd_and, op_and)
MEMU_SIMD_REDUCE(simd_or, op_or)
MEMU_SIMD_REDUCE(simd_xor, op_xor)
#undef MEMU_SIMD_REDUCE

#define MEMU_SIMD_PREFIX(fn, op, inclusive)                                  \
  template <class T>                                                        \
  T fn(T x, MEMU_SITE_PARAMS) {                                             \
    return metal_emu::simd_call<T>(                                         \
        #fn,                                                                \
        &metal_emu::resolve_prefix<T, detail::op, inclusive>,               \
        x,                                                                  \
        0,                                                                  \
        MEMU_SITE);                                                         \
  }
MEMU_SIMD_PREFIX(simd_prefix_inclusive_sum, op_sum, true)
MEMU_SIMD_PREFIX(simd_prefix_exclusive_sum, op_sum, false)
MEMU_SIMD_PREFIX(simd_prefix_inclusive_product, op_product, true)
MEMU_SIMD_PREFIX(simd_prefix_exclusive_product, op_product, false)
#undef MEMU_SIMD_PREFIX

#define MEMU_SIMD_SHUFFLE(fn, kind)                                         \
  template <class T>                                                        \
  T fn(T x, ushort arg, MEMU_SITE_PARAMS) {                                 \
    return metal_emu::simd_call<T>(                                         \
        #fn,                                                                \
        &metal_emu::resolve_shuffle<T, metal_emu::Shuffle::kind>,           \
        x,                                                                  \
        int(arg),                                                           \
        MEMU_SITE);                                                         \
  }
MEMU_SIMD_SHUFFLE(simd_shuffle, index)
MEMU_SIMD_SHUFFLE(simd_shuffle_down, down)
MEMU_SIMD_SHUFFLE(simd_shuffle_up, up)
MEMU_SIMD_SHUFFLE(simd_shuffle_xor, xor_)
MEMU_SIMD_SHUFFLE(simd_shuffle_rotate_down, rotate_down)
MEMU_SIMD_SHUFFLE(simd_shuffle_rotate_up, rotate_up)
MEMU_SIMD_SHUFFLE(simd_broadcast, broadcast)
#undef MEMU_SIMD_SHUFFLE

template <class T>
T simd_broadcast_first(T x, MEMU_SITE_PARAMS) {
  return metal_emu::simd_call<T>(
      "simd_broadcast_first",
      &metal_emu::resolve_shuffle<T, metal_emu::Shuffle::broadcast_first>,
      x,
      0,
      MEMU_SITE);
}

// Result of simd_ballot / simd_active_threads_mask: one bit per lane.
struct simd_vote {
  using vote_t = uint64_t;
  vote_t v;
  explicit operator vote_t() const {
    return v;
  }
  bool all() const {
    return v == 0xFFFFFFFFull;
  }
  bool any() const {
    return v != 0;
  }
};

inline simd_vote simd_ballot(bool b, MEMU_SITE_PARAMS) {
  return simd_vote{metal_emu::simd_call<uint64_t>(
      "simd_ballot", &metal_emu::resolve_ballot, b, 1, MEMU_SITE)};
}
inline simd_vote simd_active_threads_mask(MEMU_SITE_PARAMS) {
  return simd_vote{metal_emu::simd_call<uint64_t>(
      "simd_active_threads_mask",
      &metal_emu::resolve_ballot,
      true,
      1,
      MEMU_SITE)};
}
inline bool simd_all(bool b, MEMU_SITE_PARAMS) {
  return metal_emu::simd_call<bool>(
      "simd_all",
      &metal_emu::resolve_reduce<bool, detail::op_and>,
      b,
      0,
      MEMU_SITE);
}
inline bool simd_any(bool b, MEMU_SITE_PARAMS) {
  return metal_emu::simd_call<bool>(
      "simd_any",
      &metal_emu::resolve_reduce<bool, detail::op_or>,
      b,
      0,
      MEMU_SITE);
}
inline bool simd_is_first(MEMU_SITE_PARAMS) {
  // broadcast_first of the lane id, compared with one's own.
  uint32_t lane[3];
  metal_emu::rt_attr(int(metal_emu::Attr::thread_index_in_simdgroup), lane);
  return simd_broadcast_first(lane[0], memu_file, memu_line, memu_col) ==
      lane[0];
}

} // namespace metal

// Metal spells the flags unscoped (mem_flags::mem_threadgroup works either
// way in C++).
using metal::mem_flags;
using metal::memory_order;
using metal::memory_order_relaxed;
