"""Greedy verification of MTP drafts, fused with the bundle packing."""

from __future__ import annotations

import mlx.core as mx

from mtplx_ext import _ext
from mtplx_ext._checks import (
    MAX_DRAFTS,
    require_chain_logits,
    require_int_tokens,
    require_logit_bias,
    require_logits,
)

# The layouts are the kernels' own (metal/mtplx_rules.h, shared by the CPU
# and Metal kernels), read from the extension so that there is one definition.
_BUNDLE: dict[str, int] = dict(_ext.BUNDLE_LAYOUT)
_CHAIN: dict[str, int] = dict(_ext.CHAIN_LAYOUT)

#: Column names of the [B, 5] bundle returned by the verify primitives, in
#: column order.
BUNDLE_COLUMNS: tuple[str, ...] = tuple(sorted(_BUNDLE, key=_BUNDLE.__getitem__))
COL_X0: int = _BUNDLE["x0"]
COL_DRAFT: int = _BUNDLE["draft"]
COL_SECOND: int = _BUNDLE["second"]
COL_ACCEPT: int = _BUNDLE["accept"]
COL_BONUS: int = _BUNDLE["bonus"]
#: Columns of the chain bundle ([B, K + 3] int32) of the depth-K verify
#: primitives: x0, n (accepted drafts, or INVALID), then c_1..c_{K+1}.
CHAIN_COL_X0: int = _CHAIN["x0"]
CHAIN_COL_ACCEPTED: int = _CHAIN["accepted"]
CHAIN_COL_FIRST: int = _CHAIN["first"]
#: Most drafts a chain may hold.
MAX_CHAIN_DRAFTS = MAX_DRAFTS
#: Value of ``accept`` (and of unusable token columns) for a row that must not
#: be used: non-finite logits or a token outside the vocabulary.
INVALID: int = _ext.INVALID


def verify_greedy(
    verify_logits: mx.array,
    tokens: mx.array,
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Checks each stream's MTP draft against the target's greedy choice.

    One fused pass over the verification logits replaces argmax, compare and
    stack, and yields the bundle: the one small array the decode loop reads on
    the host each cycle.

    Args:
        verify_logits: [B, 2, V] float32/float16/bfloat16 logits of the
            verification forward at the positions of x0 and of the draft.
        tokens: [B, 2] integer array of (x0, draft) per stream.
        stream: MLX stream or device to run on (default: the default stream).

    Returns:
        [B, 5] int32 bundle with columns (x0, draft, x1, accept, bonus):
        x1 = argmax(verify_logits[:, 0]), accept = int(draft == x1),
        bonus = argmax(verify_logits[:, 1]); ties go to the lowest index.
        accept is -1 when a row's logits hold NaN or +Inf (or no finite
        value), or when x0 or the draft lies outside [0, V).

    Raises:
        TypeError: an argument is not an mx.array or has the wrong dtype.
        ValueError: shapes are not [B, 2, V] and [B, 2].
    """
    logits = require_logits("verify_logits", verify_logits, 3)
    if logits.shape[1] != 2:
        raise ValueError(
            f"verify_logits must have shape [B, 2, V], got {tuple(logits.shape)}"
        )
    tok = require_int_tokens("tokens", tokens, (logits.shape[0], 2))
    return _ext.verify_greedy(logits, tok, stream=stream)


def verify_greedy_chain(
    verify_logits: mx.array,
    tokens: mx.array,
    *,
    logit_bias: tuple[mx.array, mx.array] | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Checks each stream's K chained MTP drafts against the greedy target.

    With a_j = argmax(verify_logits[:, j]) (ties to the lowest index), draft
    d_i is accepted when d_i == a_{i-1} and every earlier draft was; the
    commit after n accepted drafts is d_1..d_n, a_n. Rows past the first
    mismatch are never read, and a draft outside [0, V) is simply rejected.

    Args:
        verify_logits: [B, K + 1, V] float32/float16/bfloat16 logits of the
            verification forward of [x0, d_1..d_K], K in 1..8.
        tokens: [B, K + 1] integer (x0, d_1..d_K).
        logit_bias: optional (ids, values) [B, M] pair: a_j is the argmax of
            row j with values[b, e] added (in float32) to logit ids[b, e];
            ids outside [0, V) add nothing. On a GPU stream it travels
            as a dense [B, V] bias row per stream (the Metal kernels).
        stream: MLX stream or device to run on.

    Returns:
        [B, K + 3] int32 chain bundle: x0, n, c_1..c_{K+1} (c_j = -1 for
        j > n + 1). n = -1 (and every c -1) when x0 lies outside [0, V) or a
        needed row (0..n) holds NaN or +Inf or no finite value.

    Raises:
        TypeError: an argument is not an mx.array or has the wrong dtype.
        ValueError: shapes are not [B, K + 1, V] and [B, K + 1], or K is
            outside 1..8.
    """
    logits, K = require_chain_logits("verify_logits", verify_logits, MAX_CHAIN_DRAFTS)
    tok = require_int_tokens("tokens", tokens, (logits.shape[0], K + 1))
    bias = require_logit_bias(logit_bias, logits.shape[0])
    if bias is None:
        return _ext.verify_greedy_chain(logits, tok, stream=stream)
    return _ext.verify_greedy_chain(logits, tok, bias[0], bias[1], stream=stream)
