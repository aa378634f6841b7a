// Python bindings of the packed Linear ops (called from module.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cpu/packed_gemm.h"
#include "cpu/qgemm.h"
#include "linear_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtplx {

void bind_linear(nb::module_& m) {
  m.def(
      "pack_linear_weight",
      &mtplx::pack_linear_weight,
      "weight"_a,
      nb::kw_only(),
      "stream"_a = nb::none());
  m.def(
      "unpack_linear_weight",
      &mtplx::unpack_linear_weight,
      "w_packed"_a,
      "n"_a,
      nb::kw_only(),
      "stream"_a = nb::none());
  m.def(
      "packed_linear",
      &mtplx::packed_linear,
      "x"_a,
      "w_packed"_a,
      "n"_a,
      nb::kw_only(),
      "stream"_a = nb::none());
  m.def("packed_linear_isa", &mtplx::packed_linear_isa);
  m.def("set_packed_linear_isa", &mtplx::set_packed_linear_isa, "isa"_a);
  m.def(
      "packed_quantized_linear",
      &mtplx::packed_quantized_linear,
      "x"_a,
      "wq"_a,
      "sb"_a,
      "n"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "prefetch"_a = std::vector<mx::array>{},
      "stream"_a = nb::none());
  m.def(
      "packed_quantized_rows",
      &mtplx::packed_quantized_rows,
      "wq"_a,
      "sb"_a,
      "ids"_a,
      "n"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none());
  m.def(
      "packed_quantized_embedding",
      &mtplx::packed_quantized_embedding,
      "wq"_a,
      "sb"_a,
      "ids"_a,
      "n"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none());
  m.def("packed_quantized_linear_isa", &mtplx::packed_quantized_linear_isa);
  m.def(
      "set_packed_quantized_linear_isa",
      &mtplx::set_packed_quantized_linear_isa,
      "isa"_a);
  m.attr("QUANTIZED_PANEL") = mtplx::kQPanel;
  m.attr("PACKED_PANEL") = mtplx::kPackedPanel;
}

} // namespace mtplx
