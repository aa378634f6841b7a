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

__all__ = ["COL_N", "COL_TOKENS", "COL_X0", "INVALID", "accepted_count", "committed_tokens", "drop_drafts_beyond"]


def committed_tokens(bundle: mx.array) -> mx.array:
    """[B, K + 1] c_1..c_{K+1}."""
    return bundle[:, COL_TOKENS:]


def accepted_count(bundle: mx.array) -> mx.array:
    """[B] n, with an INVALID row read as 0 (its stream fails on the host)."""
    return mx.maximum(bundle[:, COL_N], 0)


def drop_drafts_beyond(tokens: mx.array, row_depth: mx.array) -> mx.array:
    """[B, K + 1] (x0, d_1..d_K) with row b's drafts past row_depth[b] set to -1, for verification.

    Both chain verifications reject a draft outside [0, V) and commit the
    target's own token there (greedy: its argmax; sampled: a draw from p),
    so row b commits at most row_depth[b] drafts and stays exact.
    """
    drafts = mx.arange(tokens.shape[1])[None, :]  # column j holds draft j (column 0 is x0)
    return mx.where(drafts > row_depth[:, None], -1, tokens).astype(tokens.dtype)
