// Python bindings of the greedy verification ops.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "verify_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtplx {

void bind_verify(nb::module_& m) {
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
      "logit_bias_ids"_a = nb::none(),
      "logit_bias_values"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none());
}

} // namespace mtplx
