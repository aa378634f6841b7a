// Python bindings of the fused CPU ops (called from bindings.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>

#include "fused_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtplx {

namespace {

// An attention mask argument (None, a mode string or an array) as the ops
// take it: (mode, array).
std::pair<std::string, std::optional<mx::array>> mask_arg(
    const std::optional<std::variant<std::string, mx::array>>& mask) {
  if (!mask) {
    return {"", std::nullopt};
  }
  if (std::holds_alternative<std::string>(*mask)) {
    return {std::get<std::string>(*mask), std::nullopt};
  }
  return {"", std::get<mx::array>(*mask)};
}

} // namespace

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
        auto [mode, arr] = mask_arg(mask);
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

  // keys / values: (packed, scales, biases) as mx.quantize returns them.
  m.def(
      "quantized_scaled_dot_product_attention",
      [](const mx::array& queries,
         const std::tuple<mx::array, mx::array, mx::array>& keys,
         const std::tuple<mx::array, mx::array, mx::array>& values,
         float scale,
         int bits,
         int group_size,
         const std::optional<std::variant<std::string, mx::array>>& mask,
         mx::StreamOrDevice s) {
        auto [mode, arr] = mask_arg(mask);
        auto kv = [](const std::tuple<mx::array, mx::array, mx::array>& t) {
          return QuantizedKV{std::get<0>(t), std::get<1>(t), std::get<2>(t)};
        };
        return mtplx::quantized_scaled_dot_product_attention(
            queries, kv(keys), kv(values), scale, bits, group_size, mode, arr,
            s);
      },
      "queries"_a,
      "keys"_a,
      "values"_a,
      nb::kw_only(),
      "scale"_a,
      "bits"_a,
      "group_size"_a,
      "mask"_a = nb::none(),
      "stream"_a = nb::none());
}

} // namespace mtplx
