// CPU rows of the sampled path: the transform of python/mtplx_ext/sampling/reference.py
// in double precision, without a sort of V (radix select with counting and
// mass histograms finds the kept prefix).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "mlx/dtype.h"
#include "mtplx_rules.h"

namespace mtplx::cpu {

namespace mx = mlx::core;

// One row's sampler parameters, widened from the packed float32 row.
struct RowSampler {
  double temperature;
  int top_k;
  double top_p;
  double min_p;
  double presence;
  double frequency;
  double repetition;
  bool penalties; // any penalty differs from its neutral value

  static RowSampler from_params(const float* row);
};

// An element of the order (key ascending = z descending, token ascending)
// found by a select.
struct Selected {
  bool found;
  uint64_t key;
  int token;
  int rank; // elements before it in the order
};

// A distribution over the vocabulary: weights w[j] (unnormalised, kept
// tokens only) at tokens idx[j] ascending, or at j when idx is null (dense).
struct RowDist {
  int n = 0;
  const int* idx = nullptr;
  const double* w = nullptr;
  double total = 0;

  int token_at(int j) const {
    return idx ? idx[j] : j;
  }
  // Weight of token t (0 outside the kept set).
  double weight_of(int t) const;
};

// Token ids counted once more on top of the counts (x0 and the drafts of a
// chain, up to kMaxExtraTokens); ids outside [0, V) count nothing.
struct ExtraTokens {
  const int64_t* ids = nullptr;
  int n = 0;

  // Occurrences of token t among the ids.
  int count(int64_t t) const {
    int c = 0;
    for (int e = 0; e < n; ++e) {
      c += int(ids[e] == t);
    }
    return c;
  }
  int first_index(int64_t t) const {
    for (int e = 0; e < n; ++e) {
      if (ids[e] == t) {
        return e;
      }
    }
    return -1;
  }
  bool any_in(int V) const {
    for (int e = 0; e < n; ++e) {
      if (ids[e] >= 0 && ids[e] < V) {
        return true;
      }
    }
    return false;
  }
};

// The penalised tokens of an earlier build with the same counts (from
// penalty_seen()) and how many leading extras it covered: saves a scan of
// the counts.
struct SeenPrefix {
  const std::vector<int>* tokens = nullptr;
  int n_extra = 0;
};

// Owns the buffers of one RowDist and the scratch used to build it.
class RowDistBuilder {
 public:
  explicit RowDistBuilder(int vocab);

  // Builds the distribution of one logits row (bits of `dtype`). `counts`
  // may be null; `extra` lists ids counted once more. Returns false (and
  // leaves the dist empty) when the row is unusable. `prefix`, when given,
  // must come from penalty_seen() of an earlier build with the same counts
  // and the first prefix.n_extra of these extras.
  bool build(
      const void* logits,
      mx::Dtype dtype,
      const int32_t* counts,
      const ExtraTokens& extra,
      const RowSampler& s,
      RowDist& out,
      const SeenPrefix& prefix = {});

  // The tokens with a positive count or among the extras (ascending,
  // unique) as the last build found them, or null when it did not need
  // them.
  SeenPrefix penalty_seen(int n_extra) const {
    return {seen_valid_ ? &seen_ : nullptr, n_extra};
  }

  // Rows whose top-k (or greedy pick) needs at most this many candidates
  // take the sparse path: one vectorised threshold scan of the raw logits.
  static constexpr int kSparseLimit = 4096;

  int vocab() const {
    return V_;
  }

  // V doubles free for the caller between builds (the dists built here do
  // not point into it).
  double* scratch() {
    return z_.get();
  }

 private:
  // The top-k candidates from the raw logits: fills idx_ (ascending) and z_
  // (their transformed logits) and returns 1; 0 to fall back to the dense
  // path; -1 for an unusable row.
  int sparse_top_k(
      const void* logits,
      mx::Dtype dtype,
      const int32_t* counts,
      const ExtraTokens& extra,
      const RowSampler& s,
      int k,
      bool penalised,
      const SeenPrefix& prefix,
      int& n);

  // The first element (in order) where the cumulative weight reaches
  // `target`, with its rank.
  Selected top_p_select(bool dense, int n, double target);

  int V_;
  std::unique_ptr<double[]> z_; // transformed logits at positions
  std::unique_ptr<int[]> idx_; // token of each position (compacted paths)
  std::unique_ptr<double[]> w_; // weights at positions
  std::unique_ptr<double[]> cz_, cw_; // top-p candidates: z, w
  std::unique_ptr<int[]> ci_; // top-p candidates: tokens
  std::unique_ptr<int[]> sel_a_, sel_b_; // radix select work lists
  std::vector<std::pair<int, int>> raw_; // (raw key, token) candidates
  std::vector<int> seen_; // tokens the penalties touch
  std::vector<int> base_; // work copy of a prefix
  bool seen_valid_ = false;
};

// Inverse CDF in vocabulary order: the first token whose cumulative weight
// exceeds u * total; the last token of positive weight if rounding leaves none.
int sample_row(const RowDist& d, double u);

// Draw from normalise(max(p/|p| - q/|q|, 0)), or from p when that is empty.
// `scratch` (V doubles, or null) speeds up two dense rows.
int sample_residual(
    const RowDist& p,
    const RowDist& q,
    double u,
    double* scratch);

// Validity of a raw logits row under the shared rules (mtplx_rules.h).
bool row_valid(const void* logits, mx::Dtype dtype, int V);

} // namespace mtplx::cpu
