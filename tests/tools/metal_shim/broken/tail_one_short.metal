// Test fixture, deliberately broken: the vocabulary scan stops one element early.
// A copy of metal/verify_greedy.h with one change; the emulator tests must
// catch it. Never built into the metallib.
#include <metal_stdlib>

#include "mtplx_rules.h"

using namespace metal;

namespace mtplx {

// Running argmax of one thread, one lane or the whole threadgroup.
struct ArgmaxAcc {
  int key; // largest ordered key seen
  int idx; // lowest index holding it
  int min_key; // smallest key seen (decides validity)
};

inline ArgmaxAcc argmax_identity() {
  return ArgmaxAcc{INT_MIN, INT_MAX, INT_MAX};
}

// Butterfly across the 32 lanes; every lane ends with the simdgroup result.
inline ArgmaxAcc simd_argmax(ArgmaxAcc a) {
  for (ushort offset = 16; offset > 0; offset >>= 1) {
    int other_key = simd_shuffle_xor(a.key, offset);
    int other_idx = simd_shuffle_xor(a.idx, offset);
    if (takes_over(other_key, other_idx, a.key, a.idx)) {
      a.key = other_key;
      a.idx = other_idx;
    }
  }
  a.min_key = simd_min(a.min_key);
  return a;
}

// One bundle row [x0, draft, x1, accept, bonus] (as csrc/cpu/verify_greedy).
template <typename K, typename TokT>
inline void write_bundle_row(
    device int* out,
    const device TokT* tokens,
    ArgmaxAcc r0,
    ArgmaxAcc r1,
    int vocab) {
  bool valid0 = row_is_valid(r0.key, r0.min_key, K::pos_inf(), K::neg_inf());
  bool valid1 = row_is_valid(r1.key, r1.min_key, K::pos_inf(), K::neg_inf());
  TokT x0 = tokens[0];
  TokT draft = tokens[1];
  bool x0_ok = x0 >= 0 && x0 < TokT(vocab);
  bool draft_ok = draft >= 0 && draft < TokT(vocab);
  int x1 = valid0 ? r0.idx : kInvalid;
  out[kColX0] = x0_ok ? int(x0) : kInvalid;
  out[kColDraft] = draft_ok ? int(draft) : kInvalid;
  out[kColSecond] = x1;
  out[kColBonus] = valid1 ? r1.idx : kInvalid;
  bool usable = x0_ok && draft_ok && valid0 && valid1;
  out[kColAccept] = usable ? int(int(draft) == x1) : kInvalid;
}

// logits: [B, 2, V] raw bits (K::bits_t) of float32 / float16 / bfloat16;
// tokens: [B, 2]; bundle: [B, kBundleCols]. Grid: B threadgroups of any
// multiple of 32 threads up to 1024.
template <typename K, typename TokT>
[[kernel]] void verify_greedy(
    const device typename K::bits_t* logits [[buffer(0)]],
    const device TokT* tokens [[buffer(1)]],
    device int* bundle [[buffer(2)]],
    constant int& vocab [[buffer(3)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint tg_size [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  // Per simdgroup partials: [position][key, idx, min_key][simdgroup].
  threadgroup int partials[2 * 3 * 32];

  const int V = vocab;
  const device typename K::bits_t* x0_row = logits + size_t(row) * 2 * V;
  const device typename K::bits_t* x1_row = x0_row + V;

  // Strided scan: each thread sees its indices in increasing order, so a
  // strict comparison keeps the lowest index of equal keys.
  ArgmaxAcc acc[2] = {argmax_identity(), argmax_identity()};
  for (uint i = tid; i + 1 < uint(V); i += tg_size) {
    int k0 = K::key(x0_row[i]);
    int k1 = K::key(x1_row[i]);
    if (k0 > acc[0].key) {
      acc[0].key = k0;
      acc[0].idx = int(i);
    }
    if (k1 > acc[1].key) {
      acc[1].key = k1;
      acc[1].idx = int(i);
    }
    acc[0].min_key = min(acc[0].min_key, k0);
    acc[1].min_key = min(acc[1].min_key, k1);
  }

  for (int p = 0; p < 2; ++p) {
    acc[p] = simd_argmax(acc[p]);
    if (lane == 0) {
      partials[(p * 3 + 0) * 32 + sg] = acc[p].key;
      partials[(p * 3 + 1) * 32 + sg] = acc[p].idx;
      partials[(p * 3 + 2) * 32 + sg] = acc[p].min_key;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  if (sg == 0) {
    for (int p = 0; p < 2; ++p) {
      ArgmaxAcc a = argmax_identity();
      if (lane < num_sg) {
        a.key = partials[(p * 3 + 0) * 32 + lane];
        a.idx = partials[(p * 3 + 1) * 32 + lane];
        a.min_key = partials[(p * 3 + 2) * 32 + lane];
      }
      acc[p] = simd_argmax(a);
    }
    if (lane == 0) {
      write_bundle_row<K, TokT>(
          bundle + size_t(row) * kBundleCols,
          tokens + size_t(row) * 2,
          acc[0],
          acc[1],
          V);
    }
  }
}

} // namespace mtplx

template [[host_name("verify_greedy_float32_int32")]] [[kernel]]
decltype(mtplx::verify_greedy<mtplx::F32Key, int>)
    mtplx::verify_greedy<mtplx::F32Key, int>;
