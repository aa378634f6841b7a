"""Log-probabilities of committed tokens, from the logits a cycle already has (no extra forward).

Which distribution: the raw log-softmax of the target model's logits at the
position (float32), before any sampler transform, penalty or logit bias:
what the model itself assigns, the same for greedy and sampled requests and
for accepted drafts and resampled tokens alike. (mlx-lm's server reports the
log-softmax after its logits processors, i.e. with its logit bias and
repetition penalty; ours leaves both out, so a logprob never depends on a
request's sampler settings.)

On the device, for the rows of a batch whose requests ask (the whole batch
computes them once any row asks: the batch's shape stays fixed for its
compiled steps), one [B, T, 1 + 2 * TOP_MAX] float32 array per cycle: column
0 the logprob of the token at each verified position, then the TOP_MAX most
likely token ids (exact as float32 below 2**24 ids) and their logprobs,
most likely first. The host reads it with the cycle's bundle in the same
evaluation (one wait; (K + 1) * 41 * 4 bytes per row). The cost on the
device is one logsumexp and one top-20 partition per verified row.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: Most alternatives a request may ask for (OpenAI's `top_logprobs` limit).
TOP_MAX = 20
#: Columns per position of the packed array.
COLUMNS = 1 + 2 * TOP_MAX


def packed_logprobs(logits: mx.array, tokens: mx.array) -> mx.array:
    """[B, T, V] logits and [B, T] tokens (-1: none) -> [B, T, COLUMNS] float32 (layout above).

    Position t's row is the distribution of tokens[:, t]; a -1 token reads
    token 0's logprob, which the host ignores.
    """
    lg = logits.astype(mx.float32)
    lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
    V = lp.shape[-1]
    n = min(TOP_MAX, V)
    tok = mx.take_along_axis(lp, mx.maximum(tokens, 0).astype(mx.int32)[..., None], axis=-1)
    top = mx.argpartition(-lp, kth=n - 1, axis=-1)[..., :n]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    top = mx.take_along_axis(top, order, axis=-1)
    top_lp = mx.take_along_axis(top_lp, order, axis=-1)
    if n < TOP_MAX:  # a vocabulary smaller than TOP_MAX: pad with id -1
        pad = [(0, 0)] * (top.ndim - 1) + [(0, TOP_MAX - n)]
        top = mx.pad(top, pad, constant_values=-1)
        top_lp = mx.pad(top_lp, pad, constant_values=-float("inf"))
    return mx.concatenate([tok, top.astype(mx.float32), top_lp], axis=-1)


def unpack(row: np.ndarray, top: int) -> tuple[float, list[tuple[int, float]]]:
    """One position's host row ([COLUMNS]) -> (logprob, [(id, logprob)] of the `top` most likely)."""
    r = np.asarray(row, dtype=np.float64)
    ids = r[1 : 1 + TOP_MAX].astype(np.int64)
    lps = r[1 + TOP_MAX :]
    alts = [(int(ids[j]), float(lps[j])) for j in range(min(top, TOP_MAX)) if ids[j] >= 0]
    return float(r[0]), alts


__all__ = ["COLUMNS", "TOP_MAX", "packed_logprobs", "unpack"]
