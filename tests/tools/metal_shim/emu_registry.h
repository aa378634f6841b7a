// Kernel registry of the threadgroup emulator: metal2cpp.py emits one
// Registrar per [[host_name]] instantiation, with the parameter bindings it
// read from the kernel's Metal attributes.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "metal_shim.h"

namespace metal_emu {

struct KernelInfo {
  std::string name;
  std::string where;
  std::vector<Binding> bindings;
  std::function<void()> invoke; // runs the kernel body for the current thread
};

void register_kernel(KernelInfo info);

template <class T>
struct is_device_ptr : std::false_type {};
template <class T>
struct is_device_ptr<device_ptr<T>> : std::true_type {};
template <class T>
struct is_tg_ptr : std::false_type {};
template <class T>
struct is_tg_ptr<tg_ptr<T>> : std::true_type {};

std::string binding_error(const Binding& b, const char* expected);

// The argument the launcher passes for one kernel parameter.
template <class P>
decltype(auto) make_arg(const Binding& b) {
  using D = std::remove_cv_t<std::remove_reference_t<P>>;
  if constexpr (is_device_ptr<D>::value) {
    if (b.kind != Binding::buffer) {
      rt_fail(binding_error(b, "[[buffer(n)]]"));
    }
    return D(rt_buffer(b.index), 0);
  } else if constexpr (is_tg_ptr<D>::value) {
    if (b.kind != Binding::threadgroup) {
      rt_fail(binding_error(b, "[[threadgroup(n)]]"));
    }
    return D(rt_tg_param(b.index, sizeof(typename D::element_type)), 0);
  } else if constexpr (std::is_reference_v<P>) {
    if (b.kind != Binding::buffer) {
      rt_fail(binding_error(b, "[[buffer(n)]]"));
    }
    const BufferInfo* buf = rt_buffer(b.index);
    if (buf == nullptr || buf->size < sizeof(D) ||
        reinterpret_cast<uintptr_t>(buf->data) % alignof(D) != 0) {
      rt_device_oob(buf, 0, sizeof(D), alignof(D), "constant reference");
    }
    return *reinterpret_cast<const D*>(buf->data);
  } else {
    if (b.kind != Binding::attribute) {
      rt_fail(binding_error(b, "an attribute such as [[thread_position_in_grid]]"));
    }
    uint32_t v[3];
    rt_attr(b.index, v);
    if constexpr (std::is_arithmetic_v<D>) {
      return D(v[0]);
    } else {
      static_assert(is_vec<D>::value, "unsupported attribute parameter type");
      D r;
      for (int i = 0; i < int(sizeof(D) / sizeof(r.x)) && i < 3; ++i) {
        r[i] = decltype(r.x)(v[i]);
      }
      return r;
    }
  }
}

struct Registrar {
  template <class... P>
  Registrar(
      const char* name,
      const char* where,
      void (*fp)(P...),
      std::vector<Binding> binds) {
    if (binds.size() != sizeof...(P)) {
      std::fprintf(
          stderr,
          "metal emulator: %s (%s): %zu bindings for %zu parameters\n",
          name,
          where,
          binds.size(),
          sizeof...(P));
      std::abort();
    }
    register_kernel(KernelInfo{name, where, binds, [fp, binds]() {
                                 call(fp, binds, std::index_sequence_for<P...>{});
                               }});
  }

  template <class... P, size_t... I>
  static void call(
      void (*fp)(P...),
      const std::vector<Binding>& b,
      std::index_sequence<I...>) {
    fp(make_arg<P>(b[I])...);
  }
};

} // namespace metal_emu
