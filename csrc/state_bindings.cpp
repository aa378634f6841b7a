// Python bindings of the state ops (snapshot / restore, gated-delta capture).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "state_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtplx {

void bind_state(nb::module_& m) {
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
}

} // namespace mtplx
