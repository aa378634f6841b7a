// eval_cpu of SampleTokens and VerifySampled. Each row runs the transform of
// python/mtplx_ext/sampling/reference.py in double precision; the kept prefix (top-k,
// top-p, min-p) comes from radix selects over an order-preserving 64-bit key
// of the transformed logits, never from a sort of V.
#include "cpu/sampling.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/fused_common.h"
#include "cpu/half_bits.h"
#include "cpu/row_argmax.h"
#include "cpu/logit_bias.h"
#include "cpu/row_jobs.h"
#include "cpu/thread_pool.h"
#include "mtplx_rules.h"
#include "sampling_primitives.h"

// Portable wheels keep a baseline build; on x86-64 an AVX2 clone is picked at
// load time where the CPU has it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__)
#define MTPLX_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MTPLX_CLONES
#endif
#define MTPLX_INLINE inline __attribute__((always_inline))

namespace mtplx::cpu {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kOneBelow = 0x1.fffffffffffffp-1;

// ---- Logit loads (exact widening to double).

struct LoadF32 {
  using bits_t = uint32_t;
  static MTPLX_INLINE double get(uint32_t b) {
    return double(std::bit_cast<float>(b));
  }
};

struct LoadBF16 {
  using bits_t = uint16_t;
  static MTPLX_INLINE double get(uint16_t b) {
    return double(bf16_bits_to_float(b));
  }
};

struct LoadF16 {
  using bits_t = uint16_t;
  static MTPLX_INLINE double get(uint16_t h) {
    return double(half_bits_to_float(h));
  }
};

// ---- Numerics.

// exp(x) for x <= 0 (or -inf): Cody-Waite reduction and a degree-13 Taylor
// polynomial, branch-free so that the loops over V vectorise. Results below
// exp(-708) flush to 0: such a token has no say in any decision.
MTPLX_INLINE double exp_nonpos(double x) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShift = 6755399441055744.0; // 1.5 * 2^52: round to int
  // Clamp in the integer domain (x <= 0, so |x| > 708 means x < -708): a
  // floating compare would keep the loop scalar under trapping math.
  const uint64_t bx = std::bit_cast<uint64_t>(x);
  const int64_t mag = int64_t(bx & 0x7FFFFFFFFFFFFFFFull);
  const uint64_t under =
      uint64_t(0) - uint64_t(mag > std::bit_cast<int64_t>(708.0));
  const double xc = std::bit_cast<double>(
      (bx & ~under) | (std::bit_cast<uint64_t>(-708.0) & under));
  double t = xc * kLog2e + kShift;
  double n = t - kShift;
  double r = (xc - n * kLn2Hi) - n * kLn2Lo;
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  int64_t ni = std::bit_cast<int64_t>(t) - std::bit_cast<int64_t>(kShift);
  double scale = std::bit_cast<double>(uint64_t(ni + 1023) << 52);
  // Below exp(-708) flush to 0.
  return std::bit_cast<double>(std::bit_cast<uint64_t>(p * scale) & ~under);
}

// Order key: ascending key = descending z; -0 and +0 share a key.
MTPLX_INLINE uint64_t desc_key(double z) {
  uint64_t b = std::bit_cast<uint64_t>(z);
  b = (b << 1) == 0 ? 0 : b;
  uint64_t asc = (b >> 63) ? ~b : (b | (uint64_t(1) << 63));
  return ~asc;
}

MTPLX_CLONES double lane_sum(const double* x, int n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      acc[j] += x[i + j];
    }
  }
  for (int j = 0; i + j < n; ++j) {
    acc[j] += x[i + j];
  }
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
      ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// w[i] = exp(z[i] - zmax), returning lane_sum(w, n) (same lanes, same
// order of additions, so the same bits).
MTPLX_CLONES double exp_dense_sum(
    const double* z,
    double zmax,
    double* w,
    int n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const double e = exp_nonpos(z[i + j] - zmax);
      w[i + j] = e;
      acc[j] += e;
    }
  }
  for (int j = 0; i + j < n; ++j) {
    const double e = exp_nonpos(z[i + j] - zmax);
    w[i + j] = e;
    acc[j] += e;
  }
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
      ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// ---- Step 1 and 2: z = penalised(l) / T, with the max and min of z.

struct ZRange {
  double max;
  double min;
};

// Signed order of doubles as int64 (NaN excluded); max / min reductions run
// on these keys, which vectorise where floating compares would not.
MTPLX_INLINE int64_t ordered_i64(double v) {
  int64_t s = std::bit_cast<int64_t>(v);
  return s ^ ((s >> 63) & 0x7FFFFFFFFFFFFFFFll);
}

MTPLX_INLINE double from_ordered_i64(int64_t k) {
  return std::bit_cast<double>(k ^ ((k >> 63) & 0x7FFFFFFFFFFFFFFFll));
}

template <class Load, bool kPenalties>
MTPLX_INLINE ZRange transform_lanes(
    const typename Load::bits_t* x,
    int V,
    const int32_t* counts,
    const RowSampler& s,
    double t,
    double* z) {
  // Independent lanes: the max / min reductions vectorise without reordering.
  constexpr int L = 8;
  int64_t hi[L], lo[L];
  for (int j = 0; j < L; ++j) {
    hi[j] = std::numeric_limits<int64_t>::min();
    lo[j] = std::numeric_limits<int64_t>::max();
  }
  auto one = [&](int i) {
    double l = Load::get(x[i]);
    if constexpr (kPenalties) {
      // Counts alone (no additions, so no overflow); the extra tokens are
      // patched in afterwards by the caller.
      int c = counts ? counts[i] : 0;
      l = penalised_logit<double>(l, c, s.presence, s.frequency, s.repetition);
    }
    return l / t;
  };
  int i = 0;
  for (; i + L <= V; i += L) {
    for (int j = 0; j < L; ++j) {
      double v = one(i + j);
      z[i + j] = v;
      int64_t k = ordered_i64(v);
      hi[j] = k > hi[j] ? k : hi[j];
      lo[j] = k < lo[j] ? k : lo[j];
    }
  }
  for (int j = 0; i + j < V; ++j) {
    double v = one(i + j);
    z[i + j] = v;
    int64_t k = ordered_i64(v);
    hi[j] = k > hi[j] ? k : hi[j];
    lo[j] = k < lo[j] ? k : lo[j];
  }
  int64_t h = hi[0], m = lo[0];
  for (int j = 1; j < L; ++j) {
    h = hi[j] > h ? hi[j] : h;
    m = lo[j] < m ? lo[j] : m;
  }
  return {from_ordered_i64(h), from_ordered_i64(m)};
}

template <class Load>
MTPLX_INLINE ZRange transform_impl(
    const typename Load::bits_t* x,
    int V,
    const int32_t* counts,
    const RowSampler& s,
    double t,
    double* z) {
  return s.penalties ? transform_lanes<Load, true>(x, V, counts, s, t, z)
                     : transform_lanes<Load, false>(x, V, counts, s, t, z);
}

MTPLX_CLONES ZRange transform_f32(
    const uint32_t* x,
    int V,
    const int32_t* c,
    const RowSampler& s,
    double t,
    double* z) {
  return transform_impl<LoadF32>(x, V, c, s, t, z);
}

MTPLX_CLONES ZRange transform_f16(
    const uint16_t* x,
    int V,
    const int32_t* c,
    const RowSampler& s,
    double t,
    double* z) {
  return transform_impl<LoadF16>(x, V, c, s, t, z);
}

MTPLX_CLONES ZRange transform_bf16(
    const uint16_t* x,
    int V,
    const int32_t* c,
    const RowSampler& s,
    double t,
    double* z) {
  return transform_impl<LoadBF16>(x, V, c, s, t, z);
}

// ---- Radix select over the order (key ascending, token ascending).

enum class SelectMode { kRank, kMass };

// Candidates are positions j in [0, n) with transformed logit z[j], token
// idx[j] (j when idx is null; tokens ascend with j) and, for kMass, mass[j].
// kRank finds the element of rank `rank`; kMass the first element whose
// inclusive cumulative mass reaches `target`.
class RadixSelect {
 public:
  static constexpr int kBits = 11;
  static constexpr int kBuckets = 1 << kBits;

  RadixSelect(const double* z, const int* idx, const double* mass, int n)
      : z_(z), idx_(idx), mass_(mass), n_(n) {}

  Selected run(
      SelectMode mode,
      int rank,
      double target,
      int* buf_a,
      int* buf_b) {
    uint64_t lo = ~uint64_t(0), hi = 0;
    for (int j = 0; j < n_; ++j) {
      uint64_t k = key(j);
      lo = k < lo ? k : lo;
      hi = k > hi ? k : hi;
    }
    const int* cur = nullptr; // null: every position
    int cn = n_;
    int before = 0;
    double mass_before = 0;
    bool narrowed = false;
    while (true) {
      if (lo == hi || cn <= 32) {
        return finish(
            mode,
            rank,
            target,
            cur,
            cn,
            lo == hi,
            before,
            mass_before,
            narrowed);
      }
      const int shift = std::max(0, 64 - std::countl_zero(lo ^ hi) - kBits);
      const uint64_t base = lo >> shift;
      const int nb = int((hi >> shift) - base) + 1;
      std::fill(cnt_, cnt_ + nb, 0);
      if (mode == SelectMode::kMass) {
        std::fill(msum_, msum_ + nb, 0.0);
      }
      for (int q = 0; q < cn; ++q) {
        int j = cur ? cur[q] : q;
        int d = int((key(j) >> shift) - base);
        cnt_[d]++;
        if (mode == SelectMode::kMass) {
          msum_[d] += mass_[j];
        }
      }
      int pick = -1;
      for (int b = 0; b < nb; ++b) {
        if (mode == SelectMode::kRank) {
          if (before + cnt_[b] > rank) {
            pick = b;
            break;
          }
        } else if (cnt_[b] > 0 && mass_before + msum_[b] >= target) {
          pick = b;
          break;
        } else {
          mass_before += msum_[b];
        }
        before += cnt_[b];
      }
      if (pick < 0) {
        return {false, 0, -1, before};
      }
      narrowed = true;
      int* out = (cur == buf_a) ? buf_b : buf_a;
      int on = 0;
      uint64_t nlo = ~uint64_t(0), nhi = 0;
      for (int q = 0; q < cn; ++q) {
        int j = cur ? cur[q] : q;
        uint64_t k = key(j);
        if (int((k >> shift) - base) == pick) {
          out[on++] = j;
          nlo = k < nlo ? k : nlo;
          nhi = k > nhi ? k : nhi;
        }
      }
      cur = out;
      cn = on;
      lo = nlo;
      hi = nhi;
    }
  }

 private:
  int token(int j) const {
    return idx_ ? idx_[j] : j;
  }
  uint64_t key(int j) const {
    return desc_key(z_[j]);
  }

  Selected finish(
      SelectMode mode,
      int rank,
      double target,
      const int* cur,
      int cn,
      bool equal_keys,
      int before,
      double mass_before,
      bool narrowed) {
    // Positions ascend, so tokens ascend; equal keys are then in order.
    int small[32];
    int m = 0;
    std::vector<int> big;
    int* list = small;
    if (cn > 32) {
      big.resize(cn);
      list = big.data();
    }
    for (int q = 0; q < cn; ++q) {
      list[m++] = cur ? cur[q] : q;
    }
    if (!equal_keys) {
      std::sort(list, list + m, [this](int a, int b) {
        uint64_t ka = key(a), kb = key(b);
        return ka < kb || (ka == kb && token(a) < token(b));
      });
    }
    for (int q = 0; q < m; ++q) {
      int j = list[q];
      if (mode == SelectMode::kRank) {
        if (before == rank) {
          return {true, key(j), token(j), before};
        }
      } else {
        mass_before += mass_[j];
        if (mass_before >= target) {
          return {true, key(j), token(j), before};
        }
      }
      ++before;
    }
    // A bucket whose histogram mass crossed the target but whose sequential
    // sum just misses it (rounding): its last element is the crossing.
    if (mode == SelectMode::kMass && narrowed && m > 0) {
      int j = list[m - 1];
      return {true, key(j), token(j), before - 1};
    }
    return {false, 0, -1, before};
  }

  const double* z_;
  const int* idx_;
  const double* mass_;
  int n_;
  int cnt_[kBuckets];
  double msum_[kBuckets];
};

// Keeps the positions at or before `t` in the order, compacting z, idx (set
// from j when dense) and w (when given) in place; returns how many remain.
int keep_prefix(
    double* z,
    int* idx,
    double* w,
    bool dense,
    int n,
    const Selected& t) {
  int on = 0;
  for (int j = 0; j < n; ++j) {
    int tok = dense ? j : idx[j];
    uint64_t k = desc_key(z[j]);
    if (k < t.key || (k == t.key && tok <= t.token)) {
      z[on] = z[j];
      idx[on] = tok;
      if (w) {
        w[on] = w[j];
      }
      ++on;
    }
  }
  return on;
}

// ---- Sparse top-k: a threshold scan over the raw logit keys.

// Without penalties z = l / T orders tokens exactly as the raw logits do
// (distinct float16/bfloat16/float32 values stay distinct and ordered after a
// double division), so the k largest raw keys, ties at the threshold
// included, contain the top-k of z. Penalised tokens are added separately,
// and the scan skips them: a token left out of the k largest keys among the
// unpenalised ones has k unpenalised tokens strictly above it in z as well.
// Result of a raw top-k scan.
enum class RawTop { kOk, kFallback, kInvalid };

// The (key, token) candidates of a scan: every key at or above `thr`, where
// thr is the k-th largest key among the candidates at the last shrink. The
// final set (all keys at or above the k-th largest of the row) does not
// depend on when shrinks happen; shrinking long before the buffer is full
// keeps the threshold near the k-th largest key seen so far, so that few
// blocks of the scan take the scalar path.
class TopCollector {
 public:
  // Tokens in `skip` (ascending) are never candidates.
  TopCollector(
      std::vector<std::pair<int, int>>& buf,
      int k,
      const std::vector<int>& skip)
      : buf_(buf),
        skip_(skip),
        k_(k),
        cap_(size_t(std::max(4 * k, 1024))),
        trigger_(std::min(cap_, size_t(2 * k + 64))) {
    buf_.clear();
    buf_.reserve(cap_ + 128);
  }

  int threshold() const {
    return thr_;
  }
  bool ties_ok() const {
    return ties_ok_;
  }

  // Takes the keys at or above the threshold among x[i0, i0 + n); true when
  // the threshold changed.
  template <class K>
  MTPLX_INLINE bool take(const typename K::bits_t* x, int i0, int n) {
    for (int j = 0; j < n; ++j) {
      int kj = K::key(x[i0 + j]);
      if (kj >= thr_ && !skipped(i0 + j)) {
        buf_.emplace_back(kj, i0 + j);
      }
    }
    if (buf_.size() >= trigger_) {
      ties_ok_ = shrink();
      return true;
    }
    return false;
  }

  // The final shrink; false when ties make the sparse path unsuitable.
  bool finish() {
    if (ties_ok_ && int(buf_.size()) > k_) {
      ties_ok_ = shrink();
    }
    return ties_ok_;
  }

 private:
  bool shrink() {
    // Keep the k largest keys and every tie of the k-th.
    std::nth_element(
        buf_.begin(),
        buf_.begin() + (k_ - 1),
        buf_.end(),
        [](auto& a, auto& b) { return a.first > b.first; });
    thr_ = buf_[k_ - 1].first;
    size_t on = 0;
    for (size_t q = 0; q < buf_.size(); ++q) {
      if (buf_[q].first >= thr_) {
        buf_[on++] = buf_[q];
      }
    }
    buf_.resize(on);
    trigger_ = std::min(cap_, 2 * on + 64);
    return on <= cap_ / 2; // false: too many ties for this path
  }

  bool skipped(int token) const {
    return !skip_.empty() &&
        std::binary_search(skip_.begin(), skip_.end(), token);
  }

  std::vector<std::pair<int, int>>& buf_;
  const std::vector<int>& skip_;
  int k_;
  size_t cap_;
  size_t trigger_;
  int thr_ = std::numeric_limits<int>::min();
  bool ties_ok_ = true;
};

// 16-bit logits: blocks of four 32-byte vectors of keys. The same scan
// gathers the row's largest and smallest keys: the validity rule of
// mtplx_rules.h needs nothing else.
template <class K>
MTPLX_INLINE RawTop raw_top_keys(
    const typename K::bits_t* x,
    int V,
    int k,
    const std::vector<int>& skip,
    std::vector<std::pair<int, int>>& buf) {
  using KV = KeyVec<K>;
  using key_t = typename KV::key_t;
  using vec = typename KV::vec;
  typedef uint64_t u64x4 __attribute__((vector_size(32)));
  constexpr int L = KV::lanes;
  constexpr int kBlock = 4 * L;
  TopCollector top(buf, k, skip);
  vec hi0 = vec{} + std::numeric_limits<key_t>::min(), hi1 = hi0;
  vec lo0 = vec{} + std::numeric_limits<key_t>::max(), lo1 = lo0;
  vec tv = vec{} + std::numeric_limits<key_t>::min();
  int i = 0;
  for (; i + kBlock <= V; i += kBlock) {
    vec k0 = KV::load_keys(x + i);
    vec k1 = KV::load_keys(x + i + L);
    vec k2 = KV::load_keys(x + i + 2 * L);
    vec k3 = KV::load_keys(x + i + 3 * L);
    vec a = k0 > k1 ? k0 : k1;
    vec b = k2 > k3 ? k2 : k3;
    vec c = k0 < k1 ? k0 : k1;
    vec d = k2 < k3 ? k2 : k3;
    hi0 = a > hi0 ? a : hi0;
    hi1 = b > hi1 ? b : hi1;
    lo0 = c < lo0 ? c : lo0;
    lo1 = d < lo1 ? d : lo1;
    u64x4 hit = (u64x4)((a >= tv) | (b >= tv));
    if ((hit[0] | hit[1] | hit[2] | hit[3]) && top.ties_ok() &&
        top.template take<K>(x, i, kBlock)) {
      tv = vec{} + key_t(top.threshold());
    }
  }
  hi0 = hi1 > hi0 ? hi1 : hi0;
  lo0 = lo1 < lo0 ? lo1 : lo0;
  int h = hi0[0], m = lo0[0];
  for (int j = 1; j < L; ++j) {
    h = hi0[j] > h ? int(hi0[j]) : h;
    m = lo0[j] < m ? int(lo0[j]) : m;
  }
  for (int j = i; j < V; ++j) {
    int kj = K::key(x[j]);
    h = kj > h ? kj : h;
    m = kj < m ? kj : m;
  }
  if (!row_is_valid(h, m, K::pos_inf(), K::neg_inf())) {
    return RawTop::kInvalid;
  }
  if (i < V && top.ties_ok()) {
    top.template take<K>(x, i, V - i);
  }
  return top.finish() ? RawTop::kOk : RawTop::kFallback;
}

// float32 logits: the block filter and the extremes compare floats directly
// (fewer instructions per vector than keys; for non-NaN values float order is
// key order with -0 == +0). NaN is caught by x != x, +Inf / all -Inf by the
// largest value; the candidates themselves are still chosen on keys.
MTPLX_INLINE RawTop raw_top_floats(
    const uint32_t* xb,
    int V,
    int k,
    const std::vector<int>& skip,
    std::vector<std::pair<int, int>>& buf) {
  typedef float vf __attribute__((vector_size(32)));
  typedef int32_t vi __attribute__((vector_size(32)));
  typedef uint64_t u64x4 __attribute__((vector_size(32)));
  constexpr int L = 8;
  constexpr int kBlock = 4 * L;
  constexpr float inf = std::numeric_limits<float>::infinity();
  const float* x = reinterpret_cast<const float*>(xb);
  TopCollector top(buf, k, skip);
  vf hi0 = vf{} - inf, hi1 = hi0;
  vi nan0 = vi{}, nan1 = vi{};
  vf tv = vf{} - inf; // every non-NaN value passes until the first shrink
  int i = 0;
  for (; i + kBlock <= V; i += kBlock) {
    vf v0, v1, v2, v3;
    std::memcpy(&v0, x + i, sizeof(vf));
    std::memcpy(&v1, x + i + L, sizeof(vf));
    std::memcpy(&v2, x + i + 2 * L, sizeof(vf));
    std::memcpy(&v3, x + i + 3 * L, sizeof(vf));
    nan0 |= (v0 != v0) | (v1 != v1);
    nan1 |= (v2 != v2) | (v3 != v3);
    vf a = v0 > v1 ? v0 : v1;
    vf b = v2 > v3 ? v2 : v3;
    hi0 = a > hi0 ? a : hi0;
    hi1 = b > hi1 ? b : hi1;
    u64x4 hit = (u64x4)((v0 >= tv) | (v1 >= tv) | (v2 >= tv) | (v3 >= tv));
    if ((hit[0] | hit[1] | hit[2] | hit[3]) && top.ties_ok() &&
        top.take<F32Key>(xb, i, kBlock)) {
      // The threshold as a float (a NaN threshold only arises in an invalid
      // row, whose candidates are never used).
      const int t = top.threshold();
      tv = vf{} +
          std::bit_cast<float>(uint32_t(t ^ ((t >> 31) & 0x7FFFFFFF)));
    }
  }
  hi0 = hi1 > hi0 ? hi1 : hi0;
  nan0 |= nan1;
  float h = -inf;
  bool nan = false;
  for (int j = 0; j < L; ++j) {
    h = hi0[j] > h ? hi0[j] : h;
    nan |= nan0[j] != 0;
  }
  for (int j = i; j < V; ++j) {
    h = x[j] > h ? x[j] : h;
    nan |= x[j] != x[j];
  }
  if (nan || !(h < inf) || !(h > -inf)) {
    return RawTop::kInvalid;
  }
  if (i < V && top.ties_ok()) {
    top.take<F32Key>(xb, i, V - i);
  }
  return top.finish() ? RawTop::kOk : RawTop::kFallback;
}

MTPLX_CLONES RawTop raw_top_f32(
    const uint32_t* x,
    int V,
    int k,
    const std::vector<int>& skip,
    std::vector<std::pair<int, int>>& buf) {
  return raw_top_floats(x, V, k, skip, buf);
}

MTPLX_CLONES RawTop raw_top_f16(
    const uint16_t* x,
    int V,
    int k,
    const std::vector<int>& skip,
    std::vector<std::pair<int, int>>& buf) {
  return raw_top_keys<F16Key>(x, V, k, skip, buf);
}

MTPLX_CLONES RawTop raw_top_bf16(
    const uint16_t* x,
    int V,
    int k,
    const std::vector<int>& skip,
    std::vector<std::pair<int, int>>& buf) {
  return raw_top_keys<BF16Key>(x, V, k, skip, buf);
}

// Tokens with a positive count, ascending.
MTPLX_CLONES void positive_counts(
    const int32_t* c,
    int V,
    std::vector<int>& out) {
  constexpr int L = 64;
  for (int i = 0; i < V; i += L) {
    const int len = std::min(L, V - i);
    int any = 0;
    for (int j = 0; j < len; ++j) {
      any |= int(c[i + j] > 0);
    }
    if (!any) {
      continue;
    }
    for (int j = 0; j < len; ++j) {
      if (c[i + j] > 0) {
        out.push_back(i + j);
      }
    }
  }
}

double logit_at(const void* x, mx::Dtype dtype, int i) {
  if (dtype == mx::float32) {
    return LoadF32::get(static_cast<const uint32_t*>(x)[i]);
  } else if (dtype == mx::float16) {
    return LoadF16::get(static_cast<const uint16_t*>(x)[i]);
  }
  return LoadBF16::get(static_cast<const uint16_t*>(x)[i]);
}

} // namespace

RowSampler RowSampler::from_params(const float* row) {
  // Values outside their documented ranges act as "off" (NaN included).
  RowSampler s;
  float t = row[kParamTemperature];
  s.temperature = t > 0 && std::isfinite(t) ? double(t) : 0.0;
  float k = row[kParamTopK];
  s.top_k = (k >= 1 && k < float(1 << 30)) ? int(k) : 0;
  float tp = row[kParamTopP];
  s.top_p = tp < 1 ? double(tp) : 1.0;
  float mp = row[kParamMinP];
  s.min_p = mp > 0 ? double(mp) : 0.0;
  float pr = row[kParamPresence];
  float fr = row[kParamFrequency];
  float rp = row[kParamRepetition];
  s.presence = std::isfinite(pr) ? double(pr) : 0.0;
  s.frequency = std::isfinite(fr) ? double(fr) : 0.0;
  s.repetition = (std::isfinite(rp) && rp > 0) ? double(rp) : 1.0;
  s.penalties = s.presence != 0 || s.frequency != 0 || s.repetition != 1;
  return s;
}

double RowDist::weight_of(int t) const {
  if (t < 0) {
    return 0;
  }
  if (!idx) {
    return t < n ? w[t] : 0;
  }
  const int* it = std::lower_bound(idx, idx + n, t);
  return (it != idx + n && *it == t) ? w[it - idx] : 0;
}

RowDistBuilder::RowDistBuilder(int vocab)
    : V_(vocab),
      z_(new double[vocab]),
      idx_(new int[vocab]),
      w_(new double[vocab]),
      cz_(new double[vocab]),
      cw_(new double[vocab]),
      ci_(new int[vocab]),
      sel_a_(new int[vocab]),
      sel_b_(new int[vocab]) {}

bool row_valid(const void* logits, mx::Dtype dtype, int V) {
  if (dtype == mx::float32) {
    return row_argmax_f32(static_cast<const uint32_t*>(logits), V).valid;
  } else if (dtype == mx::float16) {
    return row_argmax_f16(static_cast<const uint16_t*>(logits), V).valid;
  }
  return row_argmax_bf16(static_cast<const uint16_t*>(logits), V).valid;
}

int RowDistBuilder::sparse_top_k(
    const void* logits,
    mx::Dtype dtype,
    const int32_t* counts,
    const ExtraTokens& extra,
    const RowSampler& s,
    int k,
    bool penalised,
    const SeenPrefix& prefix,
    int& n) {
  const int V = V_;
  seen_valid_ = false;
  if (penalised) {
    // The tokens of counts and of the extras, ascending and unique; a prefix
    // from an earlier build with the same counts covers the first extras.
    // (Copied first: the prefix may be this builder's own seen_.)
    int from = 0;
    if (prefix.tokens) {
      base_.assign(prefix.tokens->begin(), prefix.tokens->end());
      from = prefix.n_extra;
    } else {
      base_.clear();
      if (counts) {
        positive_counts(counts, V, base_);
      }
    }
    seen_.swap(base_);
    for (int e = from; e < extra.n; ++e) {
      const int64_t t = extra.ids[e];
      if (t >= 0 && t < V) {
        auto at = std::lower_bound(seen_.begin(), seen_.end(), int(t));
        if (at == seen_.end() || *at != int(t)) {
          seen_.insert(at, int(t));
        }
      }
    }
    seen_valid_ = true;
  } else {
    seen_.clear();
  }
  const int k2 = k + int(seen_.size());
  if (k2 > kSparseLimit || k2 >= V / 4) {
    return 0;
  }
  RawTop st;
  if (dtype == mx::float32) {
    st = raw_top_f32(static_cast<const uint32_t*>(logits), V, k, seen_, raw_);
  } else if (dtype == mx::float16) {
    st = raw_top_f16(static_cast<const uint16_t*>(logits), V, k, seen_, raw_);
  } else {
    st = raw_top_bf16(static_cast<const uint16_t*>(logits), V, k, seen_, raw_);
  }
  if (st != RawTop::kOk) {
    return st == RawTop::kInvalid ? -1 : 0;
  }
  // Candidates: the raw top-k of the unpenalised tokens and every penalised
  // token, ascending and unique.
  int* idx = idx_.get();
  int m = 0;
  for (auto& kv : raw_) {
    idx[m++] = kv.second;
  }
  for (int t : seen_) {
    idx[m++] = t;
  }
  std::sort(idx, idx + m);
  m = int(std::unique(idx, idx + m) - idx);
  double* z = z_.get();
  const double t = s.temperature > 0 ? s.temperature : 1.0;
  for (int j = 0; j < m; ++j) {
    const int tok = idx[j];
    double l = logit_at(logits, dtype, tok);
    if (penalised) {
      const int c = penalty_count(counts ? counts[tok] : 0, extra.count(tok));
      l = penalised_logit<double>(l, c, s.presence, s.frequency, s.repetition);
    }
    z[j] = l / t;
  }
  n = m;
  return 1;
}

namespace {

// Mass of w per level: level L holds weights in [4^-(L+1), 4^-L) (w <= 1),
// the last level everything smaller. Four interleaved copies hide the
// latency of repeated adds to one level.
constexpr int kLevels = 32;

MTPLX_INLINE int weight_level(double w) {
  int e = int(std::bit_cast<uint64_t>(w) >> 52); // w >= 0: biased exponent
  int l = (1023 - e) >> 1;
  l = l < 0 ? 0 : l;
  return l < kLevels - 1 ? l : kLevels - 1;
}

void level_masses(const double* w, int n, double* out) {
  double acc[4][kLevels] = {};
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) {
      acc[j][weight_level(w[i + j])] += w[i + j];
    }
  }
  for (; i < n; ++i) {
    acc[0][weight_level(w[i])] += w[i];
  }
  for (int l = 0; l < kLevels; ++l) {
    out[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
  }
}

} // namespace

Selected RowDistBuilder::top_p_select(bool dense, int n, double target) {
  double* z = z_.get();
  int* idx = idx_.get();
  double* w = w_.get();
  if (dense && n > 8192) {
    // Only the levels needed to reach the target (with a margin for
    // rounding) can hold the crossing: select among their tokens alone.
    double lm[kLevels];
    level_masses(w, n, lm);
    double cum = 0;
    int last = kLevels - 1;
    for (int l = 0; l < kLevels - 1; ++l) {
      cum += lm[l];
      if (cum >= target * (1 + 1e-9)) {
        last = l;
        break;
      }
    }
    if (last < kLevels - 1) {
      double* cz = cz_.get();
      double* cw = cw_.get();
      int* ci = ci_.get();
      int c = 0;
      for (int j = 0; j < n; ++j) {
        if (weight_level(w[j]) <= last) {
          cz[c] = z[j];
          cw[c] = w[j];
          ci[c] = j;
          ++c;
        }
      }
      RadixSelect sel(cz, ci, cw, c);
      Selected th =
          sel.run(SelectMode::kMass, 0, target, sel_a_.get(), sel_b_.get());
      if (th.found) {
        return th;
      }
    }
  }
  RadixSelect sel(z, dense ? nullptr : idx, w, n);
  return sel.run(SelectMode::kMass, 0, target, sel_a_.get(), sel_b_.get());
}

bool RowDistBuilder::build(
    const void* logits,
    mx::Dtype dtype,
    const int32_t* counts,
    const ExtraTokens& extra,
    const RowSampler& s,
    RowDist& out,
    const SeenPrefix& prefix) {
  out = RowDist{};
  seen_valid_ = false;
  const int V = V_;
  const bool greedy = !(s.temperature > 0);
  const bool penalised = s.penalties && (counts || extra.any_in(V));
  double* z = z_.get();
  int* idx = idx_.get();
  double* w = w_.get();
  const int kk = greedy ? 1 : top_k_length(s.top_k, V);
  int n = V;
  bool dense = true;
  double zmax = 0;
  // Sparse scans check validity themselves; the dense path reads it from
  // the range of the transform.
  const int sparse = kk < V
      ? sparse_top_k(logits, dtype, counts, extra, s, kk, penalised, prefix, n)
      : 0;
  if (sparse < 0) {
    return false;
  }
  if (sparse > 0) {
    dense = false;
  } else {
    RowSampler sp = s;
    sp.penalties = penalised && counts;
    const double t = greedy ? 1.0 : s.temperature;
    ZRange r;
    if (dtype == mx::float32) {
      r = transform_f32(
          static_cast<const uint32_t*>(logits), V, counts, sp, t, z);
    } else if (dtype == mx::float16) {
      r = transform_f16(
          static_cast<const uint16_t*>(logits), V, counts, sp, t, z);
    } else {
      r = transform_bf16(
          static_cast<const uint16_t*>(logits), V, counts, sp, t, z);
    }
    // The transform maps NaN to NaN, +Inf to +Inf, -Inf to -Inf and finite
    // logits to finite values (penalties and 1/T cannot overflow a double
    // from 16/32-bit floats), so the rule of row_valid reads off its range:
    // no NaN (of either sign), no +Inf, some value above -Inf.
    if (!(r.max < kInf && r.min >= -kInf && r.max > -kInf)) {
      return false;
    }
    zmax = r.max;
    if (penalised && extra.any_in(V)) {
      // The extra tokens' occurrences, patched into their few entries (a
      // compare per extra and logit would slow the scan for every row).
      bool rescan = false;
      for (int e = 0; e < extra.n; ++e) {
        const int64_t tok = extra.ids[e];
        if (tok < 0 || tok >= V || extra.first_index(tok) != e) {
          continue;
        }
        const int c = penalty_count(counts ? counts[tok] : 0, extra.count(tok));
        const double l = penalised_logit<double>(
            logit_at(logits, dtype, int(tok)),
            c,
            s.presence,
            s.frequency,
            s.repetition);
        rescan |= z[tok] == zmax;
        z[tok] = l / t;
        zmax = z[tok] > zmax ? z[tok] : zmax;
      }
      if (rescan) {
        // The old maximum may have moved down: find the new one.
        zmax = -kInf;
        for (int i = 0; i < V; ++i) {
          zmax = z[i] > zmax ? z[i] : zmax;
        }
      }
    }
  }
  if (n > kk) {
    RadixSelect sel(z, dense ? nullptr : idx, nullptr, n);
    Selected th =
        sel.run(SelectMode::kRank, kk - 1, 0, sel_a_.get(), sel_b_.get());
    n = keep_prefix(z, idx, nullptr, dense, n, th);
    dense = false;
  }
  if (greedy) {
    // Point mass on the first maximum (ties: lowest index).
    w[0] = 1.0;
    out = RowDist{1, dense ? nullptr : idx, w, 1.0};
    return true;
  }
  if (!dense) {
    // The maximum of z is among the kept candidates (top-1 always is).
    zmax = z[0];
    for (int j = 1; j < n; ++j) {
      zmax = z[j] > zmax ? z[j] : zmax;
    }
  }
  // w and its lane_sum in one pass.
  const double wsum = exp_dense_sum(z, zmax, w, n);
  int m = n;
  Selected cut{false, 0, -1, 0}; // the last kept element, when known
  if (s.top_p < 1) {
    const double target = s.top_p * wsum;
    Selected th = top_p_select(dense, n, target);
    if (th.found && th.rank + 1 < m) {
      m = th.rank + 1;
      cut = th;
    }
  }
  if (s.min_p > 0) {
    int c = 0;
    for (int j = 0; j < n; ++j) {
      c += int(w[j] >= s.min_p);
    }
    if (std::max(c, 1) < m) {
      m = std::max(c, 1);
      cut.found = false;
    }
  }
  if (m < n) {
    if (!cut.found) {
      RadixSelect sel(z, dense ? nullptr : idx, nullptr, n);
      cut = sel.run(SelectMode::kRank, m - 1, 0, sel_a_.get(), sel_b_.get());
    }
    n = keep_prefix(z, idx, w, dense, n, cut);
    dense = false;
    out = RowDist{n, idx, w, lane_sum(w, n)};
    return true;
  }
  out = RowDist{n, dense ? nullptr : idx, w, wsum};
  return true;
}

int sample_row(const RowDist& d, double u) {
  const double target = u * d.total;
  constexpr int kBlock = 1024;
  double run = 0;
  int j0 = 0;
  for (; j0 < d.n; j0 += kBlock) {
    double s = lane_sum(d.w + j0, std::min(kBlock, d.n - j0));
    if (run + s > target) {
      break;
    }
    run += s;
  }
  for (int j = j0; j < d.n; ++j) {
    run += d.w[j];
    if (run > target) {
      return d.token_at(j);
    }
  }
  for (int j = d.n - 1; j >= 0; --j) {
    if (d.w[j] > 0) {
      return d.token_at(j);
    }
  }
  return d.token_at(0);
}

namespace {

// Calls f(token, wp, wq) for every token kept by p or q, ascending.
template <class F>
void for_each_union(const RowDist& p, const RowDist& q, F&& f) {
  int i = 0, j = 0;
  constexpr int kEnd = std::numeric_limits<int>::max();
  while (i < p.n || j < q.n) {
    int tp = i < p.n ? p.token_at(i) : kEnd;
    int tq = j < q.n ? q.token_at(j) : kEnd;
    int t = tp < tq ? tp : tq;
    double wp = tp == t ? p.w[i++] : 0.0;
    double wq = tq == t ? q.w[j++] : 0.0;
    if (!f(t, wp, wq)) {
      return;
    }
  }
}

} // namespace

namespace {

// r[t] = max(wp[t] / sp - wq[t] / sq, 0) for two dense rows; the max is taken
// on the sign bit so that the loop vectorises.
MTPLX_CLONES void residual_dense(
    const double* wp,
    double sp,
    const double* wq,
    double sq,
    double* r,
    int n) {
  for (int i = 0; i < n; ++i) {
    double d = wp[i] / sp - wq[i] / sq;
    int64_t b = std::bit_cast<int64_t>(d);
    r[i] = std::bit_cast<double>(b & ~(b >> 63));
  }
}

} // namespace

int sample_residual(
    const RowDist& p,
    const RowDist& q,
    double u,
    double* scratch) {
  if (!p.idx && !q.idx && p.n == q.n && scratch) {
    residual_dense(p.w, p.total, q.w, q.total, scratch, p.n);
    RowDist r{p.n, nullptr, scratch, lane_sum(scratch, p.n)};
    if (!(r.total > 0)) {
      return sample_row(p, u);
    }
    return sample_row(r, u);
  }
  double total = 0;
  for_each_union(p, q, [&](int, double wp, double wq) {
    double r = wp / p.total - wq / q.total;
    total += r > 0 ? r : 0.0;
    return true;
  });
  if (!(total > 0)) {
    return sample_row(p, u);
  }
  const double target = u * total;
  double run = 0;
  int last = -1, pick = -1;
  for_each_union(p, q, [&](int t, double wp, double wq) {
    double r = wp / p.total - wq / q.total;
    if (r > 0) {
      run += r;
      last = t;
      if (run > target) {
        pick = t;
        return false;
      }
    }
    return true;
  });
  return pick >= 0 ? pick : last;
}

} // namespace mtplx::cpu

namespace mtplx {

using cpu::build_cost_ns;
using cpu::cached_builder;
using cpu::read_id;
using cpu::row_bytes;
using cpu::row_threads;
using cpu::uniform_at;

void SampleTokens::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [has_counts = has_counts_,
              has_extra = has_extra_,
              has_bias = has_bias_](std::vector<mx::array>& in, mx::array& out) {
    auto& logits = in[0];
    const int B = logits.shape(0);
    const int V = logits.shape(1);
    const float* u = in[1].data<float>();
    const float* params = in[2].data<float>();
    const int32_t* counts = has_counts ? in[3].data<int32_t>() : nullptr;
    const mx::array* extra = has_extra ? &in[has_counts ? 4 : 3] : nullptr;
    const int E = extra ? extra->shape(1) : 0;
    const int bias_at = 3 + int(has_counts) + int(has_extra);
    const char* base = static_cast<const char*>(logits.data<void>());
    const size_t rb = row_bytes(logits, V);
    const mx::Dtype dt = logits.dtype();
    int32_t* o = out.data<int32_t>();
    // Rows are independent: each task writes o[b] alone and builds in the
    // scratch of the thread that runs it.
    auto run_row = [&](int b) {
      cpu::RowDistBuilder& builder = cached_builder(0, V);
      int64_t ex[kMaxExtraTokens];
      for (int e = 0; e < E && e < kMaxExtraTokens; ++e) {
        ex[e] = read_id(*extra, size_t(b) * E + e);
      }
      auto s = cpu::RowSampler::from_params(params + size_t(b) * kParamCols);
      cpu::RowDist d;
      const cpu::LogitRow row = cpu::biased_row(
          base + b * rb, dt, V, cpu::RowBias::of(in, bias_at, has_bias, b), 0);
      bool ok = builder.build(
          row.data,
          row.dtype,
          counts ? counts + size_t(b) * V : nullptr,
          {ex, std::min(E, kMaxExtraTokens)},
          s,
          d);
      o[b] = ok ? cpu::sample_row(d, uniform_at(u, b)) : kInvalid;
    };
    double cost = 0;
    for (int b = 0; b < B; ++b) {
      cost += build_cost_ns(params + size_t(b) * kParamCols, V);
    }
    cpu::parallel_for(B, row_threads(B, cost), run_row, cost);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

void VerifySampled::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto job = [has_counts = has_counts_](
                 std::vector<mx::array>& in, mx::array& out) {
    auto& vl = in[0];
    auto& dl = in[1];
    auto& tokens = in[2];
    const int B = vl.shape(0);
    const int V = vl.shape(2);
    const float* u = in[3].data<float>();
    const float* params = in[4].data<float>();
    const int32_t* counts = has_counts ? in[5].data<int32_t>() : nullptr;
    const char* vbase = static_cast<const char*>(vl.data<void>());
    const char* dbase = static_cast<const char*>(dl.data<void>());
    const size_t rb = row_bytes(vl, V);
    const mx::Dtype dt = vl.dtype();
    int32_t* o = out.data<int32_t>();
    // Rows are independent: each task writes its bundle row alone and builds
    // in the scratch of the thread that runs it.
    auto run_row = [&](int b) {
      int32_t* row = o + size_t(b) * kBundleCols;
      const int64_t x0 = read_id(tokens, size_t(b) * 2);
      const int64_t d = read_id(tokens, size_t(b) * 2 + 1);
      const bool x0_ok = x0 >= 0 && x0 < V;
      const bool d_ok = d >= 0 && d < V;
      row[kColX0] = x0_ok ? int32_t(x0) : kInvalid;
      row[kColDraft] = d_ok ? int32_t(d) : kInvalid;
      row[kColSecond] = kInvalid;
      row[kColAccept] = kInvalid;
      row[kColBonus] = kInvalid;
      const char* v0 = vbase + (size_t(b) * 2) * rb;
      const char* v1 = v0 + rb;
      const char* dr = dbase + size_t(b) * rb;
      if (!x0_ok || !d_ok) {
        return;
      }
      cpu::RowDistBuilder& bp = cached_builder(0, V);
      cpu::RowDistBuilder& bq = cached_builder(1, V);
      const int32_t* c = counts ? counts + size_t(b) * V : nullptr;
      const auto s =
          cpu::RowSampler::from_params(params + size_t(b) * kParamCols);
      cpu::RowDist p, q;
      const int64_t ex[2] = {x0, d};
      if (!bp.build(v0, dt, c, {ex, 1}, s, p)) {
        return;
      }
      // q sees the same counts and x0: it takes the tokens the penalties
      // touch from p's build instead of scanning counts again. An unusable
      // draft row (a broken head) is only a bad proposal: rejected, and the
      // token drawn from p (acceptance probability 0 keeps the rule exact).
      const bool q_ok = bq.build(dr, dt, c, {ex, 1}, s, q, bp.penalty_seen(1));
      const double ua =
          uniform_at(u, size_t(b) * kUniformCols + kUniformAccept);
      const double ur =
          uniform_at(u, size_t(b) * kUniformCols + kUniformResample);
      // The bonus row must be usable too (as in verify_greedy); building
      // its distribution checks that, so only a rejection scans it apart.
      if (q_ok &&
          accepts_draft<double>(
              ua,
              q.weight_of(int(d)) / q.total,
              p.weight_of(int(d)) / p.total)) {
        cpu::RowDist p1;
        if (!bp.build(v1, dt, c, {ex, 2}, s, p1, bq.penalty_seen(1))) {
          return;
        }
        row[kColSecond] = int32_t(d);
        row[kColAccept] = 1;
        row[kColBonus] = cpu::sample_row(
            p1, uniform_at(u, size_t(b) * kUniformCols + kUniformBonus));
      } else if (cpu::row_valid(v1, dt, V)) {
        row[kColAccept] = 0;
        row[kColSecond] = q_ok ? cpu::sample_residual(p, q, ur, bq.scratch())
                               : cpu::sample_row(p, ur);
      }
    };
    double cost = 0; // p, q and the bonus row (or its validity scan)
    for (int b = 0; b < B; ++b) {
      cost += 3 * build_cost_ns(params + size_t(b) * kParamCols, V);
    }
    cpu::parallel_for(B, row_threads(B, cost), run_row, cost);
  };
  cpu::dispatch_cpu(stream(), inputs, out, std::move(job));
}

} // namespace mtplx
