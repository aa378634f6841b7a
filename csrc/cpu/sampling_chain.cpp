// eval_cpu of VerifySampledChain: depth-K chains of sampled drafts checked
// against one [B, K + 1] verification forward (exact multi-draft speculative
// sampling; python/mtplx_ext/sampling/reference.py defines the rule). Rows
// run on the worker pool; each row reads its logits rows only as far as the
// chain gets.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/chain_bundle.h"
#include "cpu/fused_common.h"
#include "cpu/logit_bias.h"
#include "cpu/row_jobs.h"
#include "cpu/sampling.h"
#include "mtplx_rules.h"
#include "sampling_primitives.h"

namespace mtplx {

void VerifySampledChain::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [has_counts = has_counts_, has_bias = has_bias_](std::vector<mx::array>& in, mx::array& out) {
    auto& vl = in[0];
    auto& dl = in[1];
    auto& tokens = in[2];
    const int B = vl.shape(0);
    const int T = vl.shape(1);
    const int K = T - 1;
    const int V = vl.shape(2);
    const int UC = K + 2;
    const float* u = in[3].data<float>();
    const float* params = in[4].data<float>();
    const int32_t* counts = has_counts ? in[5].data<int32_t>() : nullptr;
    const char* vbase = static_cast<const char*>(vl.data<void>());
    const char* dbase = static_cast<const char*>(dl.data<void>());
    const size_t rb = cpu::row_bytes(vl, V);
    const mx::Dtype dt = vl.dtype();
    const int bias_at = 5 + int(has_counts);
    int32_t* o = out.data<int32_t>();
    auto run_row = [&](int b) {
      // Every target and draft row of this stream is read with its bias
      // (scratch slots: 0 target, 1 draft).
      const cpu::RowBias bias = cpu::RowBias::of(in, bias_at, has_bias, b);
      auto vrow_at = [&](int j) {
        return cpu::biased_row(vbase + (size_t(b) * T + j) * rb, dt, V, bias, 0);
      };
      auto drow_at = [&](int j) {
        return cpu::biased_row(dbase + (size_t(b) * K + j) * rb, dt, V, bias, 1);
      };
      // ex = (x0, d_1..d_K): position i counts its first i entries.
      int64_t ex[kMaxExtraTokens];
      for (int j = 0; j < T; ++j) {
        ex[j] = cpu::read_id(tokens, size_t(b) * T + j);
      }
      const int64_t x0 = ex[0];
      int32_t c[kMaxChainDrafts + 1];
      int n = kInvalid;
      const float* ur = u + size_t(b) * UC;
      const int32_t* cr = counts ? counts + size_t(b) * V : nullptr;
      const auto s =
          cpu::RowSampler::from_params(params + size_t(b) * kParamCols);
      if (x0 >= 0 && x0 < V) {
        cpu::RowDistBuilder& bp = cpu::cached_builder(0, V);
        cpu::RowDistBuilder& bq = cpu::cached_builder(1, V);
        cpu::RowDist p, q;
        // Penalised tokens of the previous q build (same counts, one extra
        // fewer): saves p a scan of the counts.
        cpu::SeenPrefix prev{};
        n = 0;
        for (int i = 1; i <= K; ++i) {
          const cpu::LogitRow pr = vrow_at(i - 1);
          if (!bp.build(pr.data, pr.dtype, cr, {ex, i}, s, p, prev)) {
            n = kInvalid;
            break;
          }
          const int64_t d = ex[i];
          // A draft outside the vocabulary or an unusable draft row is only
          // a bad proposal: acceptance probability 0.
          const cpu::LogitRow qr = drow_at(i - 1);
          const bool q_ok = d >= 0 && d < V &&
              bq.build(qr.data,
                       qr.dtype,
                       cr,
                       {ex, i},
                       s,
                       q,
                       bp.penalty_seen(i));
          prev = q_ok ? bq.penalty_seen(i) : cpu::SeenPrefix{};
          const double pd = q_ok ? p.weight_of(int(d)) / p.total : 0.0;
          const double ua = cpu::uniform_at(ur, i - 1);
          if (q_ok &&
              accepts_draft<double>(ua, q.weight_of(int(d)) / q.total, pd)) {
            c[i - 1] = int32_t(d);
            n = i;
            continue;
          }
          const double uq = cpu::uniform_at(ur, chain_uniform_resample(K));
          c[i - 1] = q_ok ? cpu::sample_residual(p, q, uq, bq.scratch())
                          : cpu::sample_row(p, uq);
          break;
        }
        if (n == K) {
          // Every draft accepted: the bonus from p_{K+1}.
          const double ub = cpu::uniform_at(ur, chain_uniform_bonus(K));
          const cpu::LogitRow br = vrow_at(K);
          if (bp.build(br.data, br.dtype, cr, {ex, T}, s, p, prev)) {
            c[K] = cpu::sample_row(p, ub);
          } else {
            n = kInvalid;
          }
        }
      }
      cpu::write_chain(o + size_t(b) * (K + 3), K, V, x0, n, c);
    };
    double cost = 0; // up to K + 1 target rows and K draft rows
    for (int b = 0; b < B; ++b) {
      cost += (K + 2) * cpu::build_cost_ns(params + size_t(b) * kParamCols, V);
    }
    cpu::parallel_for(B, cpu::row_threads(B, cost), run_row, cost);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
