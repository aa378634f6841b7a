// C++ entry points of mtplx_ext. They check arguments (std::invalid_argument
// names the argument) and build the primitive's output arrays lazily.
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
// -> chain bundle [B, K + 3] int32.
mx::array verify_greedy_chain(
    const mx::array& verify_logits,
    const mx::array& tokens,
    mx::StreamOrDevice s = {});

std::vector<mx::array> snapshot_state(
    const std::vector<mx::array>& leaves,
    mx::StreamOrDevice s = {});

std::vector<mx::array> restore_state(
    const std::vector<mx::array>& live,
    const std::vector<mx::array>& snapshot,
    const std::optional<mx::array>& row_mask,
    mx::StreamOrDevice s = {});

// Gated delta rule over q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta
// [B, T, Hv], state [B, Hv, Dv, Dk] -> (y [B, T, Hv, Dv], states
// [B, T, Hv, Dv, Dk]): the state after every position.
std::vector<mx::array> gated_delta_capture(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    mx::StreamOrDevice s = {});

} // namespace mtplx
