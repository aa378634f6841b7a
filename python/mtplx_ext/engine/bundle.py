"""Reading the chain bundle on the device: the one array a depth-K cycle leaves for the host.

[B, K + 3] int32 per cycle, from `verify_greedy_chain` / `verify_sampled_chain`
(the layout is theirs, `mtplx_ext.ops.greedy_verify.CHAIN_COL_*`): x0; n, the number of
accepted drafts (0..K) or INVALID (-1) when the row cannot be used; then
c_1..c_{K+1}, the tokens after x0: the accepted drafts c_i = d_i for i <= n,
the target's own token c_{n+1}, then -1.
"""

from __future__ import annotations

import mlx.core as mx

from mtplx_ext.ops.greedy_verify import CHAIN_COL_ACCEPTED as COL_N
from mtplx_ext.ops.greedy_verify import CHAIN_COL_FIRST as COL_TOKENS
from mtplx_ext.ops.greedy_verify import CHAIN_COL_X0 as COL_X0
from mtplx_ext.ops.greedy_verify import INVALID

__all__ = ["COL_N", "COL_TOKENS", "COL_X0", "INVALID", "accepted_count", "committed_tokens"]


def committed_tokens(bundle: mx.array) -> mx.array:
    """[B, K + 1] c_1..c_{K+1}."""
    return bundle[:, COL_TOKENS:]


def accepted_count(bundle: mx.array) -> mx.array:
    """[B] n, with an INVALID row read as 0 (its stream fails on the host)."""
    return mx.maximum(bundle[:, COL_N], 0)
