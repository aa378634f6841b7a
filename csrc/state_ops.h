// C++ entry points of the state ops (snapshot / restore, gated-delta
// capture). They check arguments (std::invalid_argument names the argument)
// and build the primitives' output arrays lazily.
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mtplx {

namespace mx = mlx::core;

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
