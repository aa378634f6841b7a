// Python bindings of the sampled path (called from bindings.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "cpu/thread_pool.h"
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
      "logit_bias_ids"_a = nb::none(),
      "logit_bias_values"_a = nb::none(),
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

  m.def(
      "verify_sampled_chain",
      &mtplx::verify_sampled_chain,
      "verify_logits"_a,
      "draft_logits"_a,
      "tokens"_a,
      "uniforms"_a,
      "params"_a,
      "token_counts"_a = nb::none(),
      nb::kw_only(),
      "variant"_a = 0,
      "logit_bias_ids"_a = nb::none(),
      "logit_bias_values"_a = nb::none(),
      "stream"_a = nb::none());

  // Internal: the CPU kernels' thread count (MTPLX_CPU_THREADS or the
  // default; raises ValueError when the variable is invalid), an override
  // for tests and benchmarks (0 clears it; returns the previous override)
  // and how many jobs the worker pool has run.
  m.def("_cpu_threads", &cpu::cpu_threads);
  m.def("_set_cpu_threads", &cpu::set_cpu_threads, "n"_a);
  m.def("_cpu_pool_jobs", &cpu::pool_jobs);
}

} // namespace mtplx
