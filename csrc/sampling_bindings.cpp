// Python bindings of the sampled path (called from bindings.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "arg_checks.h"
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
      "logit_bias_ids"_a = nb::none(),
      "logit_bias_values"_a = nb::none(),
      "stream"_a = nb::none());

  // Internal: the CPU kernels' thread count (MTPLX_CPU_THREADS or the
  // default; raises ValueError when the variable is invalid), an override
  // for tests and benchmarks (0 clears it; returns the previous override)
  // and how many jobs the worker pool has run.
  // Internal: the dense [B, V] bias a GPU stream's kernels read, from the
  // padded pair (checked as the ops check it), on any stream: tests compare
  // it with the padded entries.
  m.def(
      "_dense_logit_bias",
      [](const mx::array& ids, const mx::array& values, int vocab) {
        if (vocab < 1) {
          bad_arg("vocab must be >= 1");
        }
        auto st = mx::default_stream(mx::default_device());
        auto pair = logit_bias_inputs(ids, values, ids.ndim() ? ids.shape(0) : 0, vocab, mx::to_stream(mx::Device::cpu));
        return dense_logit_bias(pair[0], pair[1], vocab, st);
      },
      "ids"_a,
      "values"_a,
      "vocab"_a);

  m.def("cpu_threads", &cpu::cpu_threads);
  m.def("set_cpu_threads", &cpu::set_cpu_threads, "n"_a);
  m.def("cpu_pool_jobs", &cpu::pool_jobs);
}

} // namespace mtplx
