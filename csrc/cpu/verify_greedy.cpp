#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/chain_bundle.h"
#include "cpu/fused_common.h"
#include "cpu/logit_bias.h"
#include "cpu/row_argmax.h"
#include "cpu/row_jobs.h"
#include "mlx/dtype.h"
#include "mtplx_rules.h"
#include "verify_primitives.h"

namespace mtplx {

namespace {

template <typename TokT>
void verify_rows(
    const void* logits,
    mx::Dtype dtype,
    const TokT* tokens,
    int32_t* out,
    int B,
    int V) {
  for (int b = 0; b < B; ++b) {
    cpu::RowArgmax r[2];
    for (int p = 0; p < 2; ++p) {
      size_t off = (size_t(b) * 2 + p) * size_t(V);
      if (dtype == mx::float32) {
        r[p] = cpu::row_argmax_f32(
            static_cast<const uint32_t*>(logits) + off, V);
      } else if (dtype == mx::float16) {
        r[p] = cpu::row_argmax_f16(
            static_cast<const uint16_t*>(logits) + off, V);
      } else {
        r[p] = cpu::row_argmax_bf16(
            static_cast<const uint16_t*>(logits) + off, V);
      }
    }
    int64_t x0 = tokens[2 * b];
    int64_t draft = tokens[2 * b + 1];
    bool x0_ok = x0 >= 0 && x0 < V;
    bool draft_ok = draft >= 0 && draft < V;
    int32_t* row = out + size_t(b) * kBundleCols;
    row[kColX0] = x0_ok ? int32_t(x0) : kInvalid;
    row[kColDraft] = draft_ok ? int32_t(draft) : kInvalid;
    row[kColSecond] = r[0].index;
    row[kColBonus] = r[1].index;
    bool usable = x0_ok && draft_ok && r[0].valid && r[1].valid;
    row[kColAccept] = usable ? int32_t(draft == r[0].index) : kInvalid;
  }
}

} // namespace

void VerifyGreedy::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [](std::vector<mx::array>& in, mx::array& out) {
    const mx::array& logits = in[0];
    const mx::array& tokens = in[1];
    const int B = logits.shape(0);
    const int V = logits.shape(2);
    const void* lp = logits.data<void>();
    int32_t* op = out.data<int32_t>();
    if (tokens.dtype() == mx::int32) {
      verify_rows(lp, logits.dtype(), tokens.data<int32_t>(), op, B, V);
    } else {
      verify_rows(lp, logits.dtype(), tokens.data<int64_t>(), op, B, V);
    }
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

namespace {

cpu::RowArgmax argmax_row(const void* row, mx::Dtype dtype, int V) {
  if (dtype == mx::float32) {
    return cpu::row_argmax_f32(static_cast<const uint32_t*>(row), V);
  } else if (dtype == mx::float16) {
    return cpu::row_argmax_f16(static_cast<const uint16_t*>(row), V);
  }
  return cpu::row_argmax_bf16(static_cast<const uint16_t*>(row), V);
}

// Rough cost of one argmax row scan (ns per logit), for the thread count.
constexpr double kArgmaxNsPerLogit = 0.3;

} // namespace

void VerifyGreedyChain::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [has_bias = has_bias_](std::vector<mx::array>& in, mx::array& out) {
    const mx::array& logits = in[0];
    const mx::array& tokens = in[1];
    const int B = logits.shape(0);
    const int T = logits.shape(1);
    const int K = T - 1;
    const int V = logits.shape(2);
    const char* base = static_cast<const char*>(logits.data<void>());
    const size_t rb = cpu::row_bytes(logits, V);
    const mx::Dtype dt = logits.dtype();
    int32_t* o = out.data<int32_t>();
    auto run_row = [&](int b) {
      const int64_t x0 = cpu::read_id(tokens, size_t(b) * T);
      int32_t c[kMaxChainDrafts + 1];
      int n = kInvalid;
      if (x0 >= 0 && x0 < V) {
        const char* r0 = base + size_t(b) * T * rb;
        const cpu::RowBias bias = cpu::RowBias::of(in, 2, has_bias, b);
        // Row j with its bias (a float32 copy only when the bias touches it).
        auto argmax_at = [&](int j) {
          const cpu::LogitRow r =
              cpu::biased_row(r0 + size_t(j) * rb, dt, V, bias, 0);
          return argmax_row(r.data, r.dtype, V);
        };
        cpu::RowArgmax a = argmax_at(0);
        n = a.valid ? 0 : kInvalid;
        // Row i is read only once d_1..d_i all matched: a broken row past
        // the first mismatch cannot affect the commit.
        while (n >= 0 && n < K) {
          const int64_t d = cpu::read_id(tokens, size_t(b) * T + n + 1);
          if (d != a.index) {
            break;
          }
          cpu::RowArgmax next = argmax_at(n + 1);
          if (!next.valid) {
            n = kInvalid;
            break;
          }
          c[n] = int32_t(d);
          a = next;
          ++n;
        }
        if (n >= 0) {
          c[n] = a.index;
        }
      }
      cpu::write_chain(o + size_t(b) * (K + 3), K, V, x0, n, c);
    };
    const double cost = double(B) * T * V * kArgmaxNsPerLogit;
    cpu::parallel_for(B, cpu::row_threads(B, cost), run_row, cost);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
