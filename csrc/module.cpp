// The mtplx_ext._ext module: build facts, limits, and each op group's
// bindings (<group>_bindings.cpp). Argument checking that needs Python
// context lives in the python/ wrappers; the C++ ops check shapes again.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mtplx_rules.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtplx {
void bind_verify(nb::module_& m); // verify_bindings.cpp
void bind_state(nb::module_& m); // state_bindings.cpp
void bind_sampling(nb::module_& m); // sampling_bindings.cpp
void bind_fused(nb::module_& m); // fused_bindings.cpp
void bind_linear(nb::module_& m); // linear_bindings.cpp
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

  // The most drafts one cycle may verify (the kernels' chain buffers).
  m.attr("MAX_CHAIN_DRAFTS") = mtplx::kMaxChainDrafts;

  // The bundle layouts the kernels write (mtplx_rules.h), column index by
  // name, so that the Python wrappers read them instead of keeping a copy.
  nb::dict bundle;
  bundle["x0"] = mtplx::kColX0;
  bundle["draft"] = mtplx::kColDraft;
  bundle["second"] = mtplx::kColSecond;
  bundle["accept"] = mtplx::kColAccept;
  bundle["bonus"] = mtplx::kColBonus;
  m.attr("BUNDLE_LAYOUT") = bundle;
  nb::dict chain;
  chain["x0"] = mtplx::kChainColX0;
  chain["accepted"] = mtplx::kChainColAccepted;
  chain["first"] = mtplx::kChainColFirst;
  m.attr("CHAIN_LAYOUT") = chain;
  // The value of an unusable token or accept entry.
  m.attr("INVALID") = mtplx::kInvalid;

  mtplx::bind_verify(m);
  mtplx::bind_state(m);
  mtplx::bind_sampling(m);
  mtplx::bind_fused(m);
  mtplx::bind_linear(m);
}
