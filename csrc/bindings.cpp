// Python bindings of mtplx_ext._ext. Argument checking that needs Python
// context lives in the python/ wrappers; the C++ ops check shapes again.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtplx {
void bind_sampling(nb::module_& m); // sampling_bindings.cpp
void bind_fused(nb::module_& m); // fused_bindings.cpp
} // namespace mtplx

NB_MODULE(_ext, m) {
  m.doc() = "mtplx_ext C++ core: fused MLX primitives for MTP decoding";

  m.def(
      "build_info",
      []() {
        nb::dict d;
        d["mlx_version"] = MTPLX_MLX_VERSION;
        d["nanobind_version"] = MTPLX_NANOBIND_VERSION;
#ifdef MTPLX_METAL
        d["metal"] = true;
#else
        d["metal"] = false;
#endif
        return d;
      },
      "Versions this extension was built against.");

  // Binding check: fails with nanobind's "incompatible function arguments"
  // when mx.array is not the mlx::core::array this module was built with.
  m.def(
      "abi_probe",
      [](const mlx::core::array& a) { return a.ndim(); },
      "a"_a);

  m.def(
      "verify_greedy",
      &mtplx::verify_greedy,
      "verify_logits"_a,
      "tokens"_a,
      nb::kw_only(),
      "stream"_a = nb::none());

  m.def(
      "verify_greedy_chain",
      &mtplx::verify_greedy_chain,
      "verify_logits"_a,
      "tokens"_a,
      nb::kw_only(),
      "stream"_a = nb::none());

  m.def(
      "snapshot_state",
      &mtplx::snapshot_state,
      "leaves"_a,
      nb::kw_only(),
      "stream"_a = nb::none());

  m.def(
      "restore_state",
      &mtplx::restore_state,
      "live"_a,
      "snapshot"_a,
      "row_mask"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none());

  m.def(
      "gated_delta_capture",
      &mtplx::gated_delta_capture,
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      nb::kw_only(),
      "stream"_a = nb::none());

  mtplx::bind_sampling(m);
  mtplx::bind_fused(m);
}
