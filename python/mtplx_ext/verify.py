"""Greedy verification of MTP drafts, fused with the bundle packing."""

from __future__ import annotations

import mlx.core as mx

from mtplx_ext import _ext
from mtplx_ext._checks import require_int_tokens, require_logits

#: Columns of the bundle returned by the verify primitives.
BUNDLE_COLUMNS = ("x0", "draft", "second", "accept", "bonus")
COL_X0, COL_DRAFT, COL_SECOND, COL_ACCEPT, COL_BONUS = range(5)
#: Value of ``accept`` (and of unusable token columns) for a row that must not
#: be used: non-finite logits or a token outside the vocabulary.
INVALID = -1


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
