// The mask argument of the attention ops (float and quantized KV), checked
// once for both: the same modes, shapes and dtypes, the same messages.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "arg_checks.h"
#include "fused_primitives.h"

namespace mtplx {

// keys with Hkv heads dividing the queries' Hq and at least one position.
inline void check_kv_heads(int Hq, int Hkv, int S) {
  if (Hkv < 1 || Hq % Hkv != 0) {
    bad_arg(
        "keys must have a number of heads dividing the queries' " +
        std::to_string(Hq) + ", got " + std::to_string(Hkv));
  }
  if (S < 1) {
    bad_arg("keys must hold at least one position, got S = 0");
  }
}

// mask_mode "" (then `mask` may hold an array) or "causal" (no array). An
// array must broadcast to [B, Hq, T, S] and be bool or of a dtype that
// promotes to `final_type`. Returns the kind and the array (if any).
inline std::pair<AttentionMask, std::optional<mx::array>> check_attention_mask(
    const std::string& mask_mode,
    const std::optional<mx::array>& mask,
    int B,
    int Hq,
    int T,
    int S,
    mx::Dtype final_type) {
  if (mask_mode == "causal") {
    if (mask) {
      bad_arg("mask: pass either \"causal\" or an array, not both");
    }
    return {AttentionMask::kCausal, std::nullopt};
  }
  if (!mask_mode.empty()) {
    bad_arg(
        "mask must be None, \"causal\" or an array, got the string \"" +
        mask_mode + "\"");
  }
  if (!mask) {
    return {AttentionMask::kNone, std::nullopt};
  }
  const mx::array& m = *mask;
  if (m.ndim() > 4) {
    bad_arg(
        "mask must have at most 4 dimensions, got shape " +
        shape_str(m.shape()));
  }
  mx::Shape full = {B, Hq, T, S};
  for (int i = 0; i < int(m.ndim()); ++i) {
    int n = m.shape(i);
    int want = full[4 - m.ndim() + i];
    if (n != 1 && n != want) {
      bad_arg(
          "mask of shape " + shape_str(m.shape()) +
          " does not broadcast to [B, Hq, T, S] = " + shape_str(full));
    }
  }
  if (m.dtype() != mx::bool_ &&
      mx::promote_types(m.dtype(), final_type) != final_type) {
    bad_arg(
        "mask must be bool or a dtype that promotes to the attention dtype");
  }
  return {AttentionMask::kArray, m};
}

} // namespace mtplx
