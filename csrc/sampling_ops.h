// C++ entry points of the sampled path. They check arguments
// (std::invalid_argument names the argument) and build the outputs lazily.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mtplx {

namespace mx = mlx::core;

// logits [B, V]; uniforms [B]; params [B, 7] float32; token_counts [B, V];
// extra_tokens [B, E] (ids counted once more, -1 for none); logit_bias_ids /
// logit_bias_values [B, M] (arg_checks.h). -> [B] int32.
mx::array sample_tokens(
    const mx::array& logits,
    const mx::array& uniforms,
    const mx::array& params,
    const std::optional<mx::array>& token_counts,
    const std::optional<mx::array>& extra_tokens,
    const std::optional<mx::array>& logit_bias_ids = std::nullopt,
    const std::optional<mx::array>& logit_bias_values = std::nullopt,
    mx::StreamOrDevice s = {});

// verify_logits [B, 2, V]; draft_logits [B, V]; tokens [B, 2] (x0, draft);
// uniforms [B, 3]; params [B, 7] float32; token_counts [B, V] (before x0).
// -> bundle [B, 5] int32.
mx::array verify_sampled(
    const mx::array& verify_logits,
    const mx::array& draft_logits,
    const mx::array& tokens,
    const mx::array& uniforms,
    const mx::array& params,
    const std::optional<mx::array>& token_counts,
    mx::StreamOrDevice s = {});

// verify_logits [B, K + 1, V] (K in 1..8); draft_logits [B, K, V]; tokens
// [B, K + 1] (x0, d_1..d_K); uniforms [B, K + 2]; params [B, 7] float32;
// token_counts [B, V] (before x0); logit_bias_ids / logit_bias_values
// [B, M] (added to the target and the draft rows). -> chain bundle
// [B, K + 3] int32.
mx::array verify_sampled_chain(
    const mx::array& verify_logits,
    const mx::array& draft_logits,
    const mx::array& tokens,
    const mx::array& uniforms,
    const mx::array& params,
    const std::optional<mx::array>& token_counts,
    const std::optional<mx::array>& logit_bias_ids = std::nullopt,
    const std::optional<mx::array>& logit_bias_values = std::nullopt,
    mx::StreamOrDevice s = {});

} // namespace mtplx
