// C++ entry points of greedy verification. They check arguments
// (std::invalid_argument names the argument) and build the primitive's
// output arrays lazily.
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mtplx {

namespace mx = mlx::core;

mx::array verify_greedy(
    const mx::array& verify_logits,
    const mx::array& tokens,
    mx::StreamOrDevice s = {});

// verify_logits [B, K + 1, V] (K in 1..8); tokens [B, K + 1] (x0, d_1..d_K).
// logit_bias_ids / logit_bias_values [B, M] (arg_checks.h): each row's
// argmax is that of its biased logits. -> chain bundle [B, K + 3] int32.
mx::array verify_greedy_chain(
    const mx::array& verify_logits,
    const mx::array& tokens,
    const std::optional<mx::array>& logit_bias_ids = std::nullopt,
    const std::optional<mx::array>& logit_bias_values = std::nullopt,
    mx::StreamOrDevice s = {});

} // namespace mtplx
