// Python bindings of the fused CPU ops (called from bindings.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "fused_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtplx {

void bind_fused(nb::module_& m) {
  m.def(
      "rms_norm",
      &mtplx::rms_norm,
      "x"_a,
      "weight"_a.none(),
      "eps"_a,
      nb::kw_only(),
      "stream"_a = nb::none());

  m.def(
      "rope",
      &mtplx::rope,
      "x"_a,
      "dims"_a,
      nb::kw_only(),
      "traditional"_a,
      "base"_a,
      "scale"_a,
      "offset"_a,
      "stream"_a = nb::none());

  m.def(
      "swiglu",
      &mtplx::swiglu,
      "gate"_a,
      "x"_a,
      nb::kw_only(),
      "stream"_a = nb::none());

  // mask: None, the string "causal", or an array.
  m.def(
      "scaled_dot_product_attention",
      [](const mx::array& queries,
         const mx::array& keys,
         const mx::array& values,
         float scale,
         const std::optional<std::variant<std::string, mx::array>>& mask,
         mx::StreamOrDevice s) {
        std::string mode;
        std::optional<mx::array> arr;
        if (mask) {
          if (std::holds_alternative<std::string>(*mask)) {
            mode = std::get<std::string>(*mask);
          } else {
            arr = std::get<mx::array>(*mask);
          }
        }
        return mtplx::scaled_dot_product_attention(
            queries, keys, values, scale, mode, arr, s);
      },
      "queries"_a,
      "keys"_a,
      "values"_a,
      nb::kw_only(),
      "scale"_a,
      "mask"_a = nb::none(),
      "stream"_a = nb::none());
}

} // namespace mtplx
