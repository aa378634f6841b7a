"""The host side of per-token logprobs: which packed rows a request's committed tokens take.

The device computes, per cycle, the logprob of the token at every verified
position (`mtplx_ext.decode.logprobs`); here a request that asked
(`Request.logprobs`, its number of alternatives) gets one entry per token it
commits: x0 takes the entry the previous cycle (or the prefill) computed for
its c_{n+1}, the accepted drafts c_1..c_n this cycle's rows 0..n - 1, and
row n is kept for the next x0. An entry is (logprob, [(id, logprob)] of the
most likely alternatives).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mtplx_ext.decode.logprobs import TOP_MAX, unpack

Entry = tuple[float, list[tuple[int, float]]]


def check_logprobs(value: object) -> int | None:
    """None (no logprobs) or the number of alternatives per token, an int in [0, TOP_MAX]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= TOP_MAX:
        raise ValueError(f"logprobs must be None or an int in [0, {TOP_MAX}] (alternatives per token), got {value!r}")
    return int(value)


def prefill_entry(r: Any, packed: Any) -> list[Entry] | None:
    """The entry of the prefill's token (its [1, 1, COLUMNS] array), kept as the next x0's too."""
    if r.logprobs is None or packed is None:
        return None
    r.lp_next = unpack(np.array(packed)[0, 0], r.logprobs)
    return [r.lp_next]


def cycle_entries(r: Any, lp: np.ndarray | None, i: int, n: int | None, x0_dropped: bool, count: int) -> list[Entry] | None:
    """The entries of the `count` tokens request r commits from row i of a cycle's [B, T, COLUMNS] host array.

    `n`: the accepted drafts (MTP), None for a plain step (its one token is
    row 0); `x0_dropped`: the commit leaves out x0 (already sent at the
    prefill).
    """
    if r.logprobs is None or lp is None:
        return None
    if n is None:
        return [unpack(lp[i, 0], r.logprobs)][:count]
    ents = [r.lp_next] + [unpack(lp[i, j], r.logprobs) for j in range(n)]
    r.lp_next = unpack(lp[i, n], r.logprobs)
    return ents[1 if x0_dropped else 0 :][:count]


__all__ = ["Entry", "check_logprobs", "cycle_entries", "prefill_entry"]
