// Python bindings of the sampled path (called from bindings.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "sampling_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtplx {

void bind_sampling(nb::module_& m) {
  m.def(
      "sample_tokens",
      &mtplx::sample_tokens,
      "logits"_a,
      "uniforms"_a,
      "params"_a,
      "token_counts"_a = nb::none(),
      "extra_tokens"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none());

  m.def(
      "verify_sampled",
      &mtplx::verify_sampled,
      "verify_logits"_a,
      "draft_logits"_a,
      "tokens"_a,
      "uniforms"_a,
      "params"_a,
      "token_counts"_a = nb::none(),
      nb::kw_only(),
      "variant"_a = 0,
      "stream"_a = nb::none());
}

} // namespace mtplx
