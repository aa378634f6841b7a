// CPU rows of the sampled path: the transform of python/mtplx_ext/sampling.py
// in double precision, without a sort of V (radix select with counting and
// mass histograms finds the kept prefix).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "mlx/dtype.h"

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

// Owns the buffers of one RowDist and the scratch used to build it.
class RowDistBuilder {
 public:
  explicit RowDistBuilder(int vocab);

  // Builds the distribution of one logits row (bits of `dtype`). `counts` may
  // be null; `extra` lists up to two ids counted once more (-1: none).
  // Returns false (and leaves the dist empty) when the row is unusable.
  // `penalty_base`, when given, must be penalty_base() of an earlier build
  // with the same counts and extra0: it saves a scan of counts.
  bool build(
      const void* logits,
      mx::Dtype dtype,
      const int32_t* counts,
      int64_t extra0,
      int64_t extra1,
      const RowSampler& s,
      RowDist& out,
      const std::vector<int>* penalty_base = nullptr);

  // The tokens with a positive count plus extra0 (ascending, unique) as the
  // last build found them, or null when it did not need them.
  const std::vector<int>* penalty_base() const {
    return base_valid_ ? &base_ : nullptr;
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
      int64_t extra0,
      int64_t extra1,
      const RowSampler& s,
      int k,
      bool penalised,
      const std::vector<int>* penalty_base,
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
  std::vector<int> base_; // seen_ without extra1
  bool base_valid_ = false;
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
