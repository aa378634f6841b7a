"""The chain bundle: what one depth-K verification leaves for the host to read.

[B, K + 3] int32 per cycle, from the verify primitives (`verify_greedy_chain`,
`verify_sampled_chain`): column 0 is x0; column 1 is n, the number of
accepted drafts (0..K), or -1 (INVALID) when the row cannot be used (x0
outside the vocabulary, or a verification row the stream needs holds NaN /
+Inf); columns 2..K + 2 are c_1..c_{K+1}, the tokens after x0: the accepted
drafts c_i = d_i for i <= n, then the target's own token c_{n+1}, then -1.
"""

from __future__ import annotations

import mlx.core as mx

COL_X0, COL_N, COL_TOKENS = 0, 1, 2
INVALID = -1


def chain_depth(bundle: mx.array) -> int:
    """K of a chain bundle."""
    return int(bundle.shape[1]) - 3


def committed_tokens(bundle: mx.array) -> mx.array:
    """[B, K + 1] c_1..c_{K+1}."""
    return bundle[:, COL_TOKENS:]


def accepted_count(bundle: mx.array) -> mx.array:
    """[B] n, with an INVALID row read as 0 (its stream fails on the host)."""
    return mx.maximum(bundle[:, COL_N], 0)


def row_is_unusable(logits: mx.array) -> mx.array:
    """[...] True where a logits row holds NaN or +Inf, or no finite value."""
    x = logits.astype(mx.float32)
    bad = mx.any(mx.isnan(x) | (x == mx.inf), axis=-1)
    return bad | ~mx.any(mx.isfinite(x), axis=-1)


def greedy_chain_composed(verify_logits: mx.array, tokens: mx.array) -> mx.array:
    """The greedy chain rule from MLX ops (the fused primitive's fallback).

    Args:
        verify_logits: [B, K + 1, V] logits at x0, d_1..d_K.
        tokens: [B, K + 1] (x0, d_1..d_K).

    Returns:
        The [B, K + 3] chain bundle (see the module docstring): d_i is
        accepted while it equals the argmax at the position before it.
    """
    B, T, V = verify_logits.shape
    K = T - 1
    tokens = tokens.astype(mx.int32)
    a = mx.argmax(verify_logits, axis=-1).astype(mx.int32)  # [B, K+1]
    d = tokens[:, 1:]
    match = (d == a[:, :-1]) & (d >= 0) & (d < V)
    n = mx.sum(mx.cumprod(match.astype(mx.int32), axis=1), axis=1)  # [B]
    pos = mx.arange(T, dtype=mx.int32)[None]
    needed = pos <= n[:, None]
    x0 = tokens[:, 0]
    invalid = mx.any(row_is_unusable(verify_logits) & needed, axis=1) | (x0 < 0) | (x0 >= V)
    target = mx.take_along_axis(a, n[:, None], axis=1)  # a_n
    d_ext = mx.concatenate([d, mx.full((B, 1), INVALID, mx.int32)], axis=1)
    c = mx.where(pos[:, :] < n[:, None], d_ext, mx.where(pos == n[:, None], target, INVALID))
    c = mx.where(invalid[:, None], INVALID, c)
    n = mx.where(invalid, INVALID, n)
    return mx.concatenate([x0[:, None], n[:, None], c], axis=1).astype(mx.int32)
