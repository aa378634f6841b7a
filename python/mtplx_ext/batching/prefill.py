"""Prefill of requests that start together: one left-padded forward, then one unpadded row each.

Requests arriving together (a fixed batch, a wave of clients) would cost one
prompt forward each if prefilled alone; here their whole prompts go through
one [G, W] forward (each left-padded to the longest, as a fixed batch's
prefill does), and each leaves with its own row of device state, its slots
moved to start at 0 (`RowState.take_unpadded`), exactly the row its prefill
alone would have left. Each row draws from its own request's seed and
sampler (a row's draws never depend on its neighbours), so x0 and the first
drafts are those of the request prefilled alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mtplx_ext.batching.batch import Rows
from mtplx_ext.cache.rows import RowState
from mtplx_ext.decode.cycle import Cycle
from mtplx_ext.decode.policies import GreedyPolicy, SampledPolicy


def group_cycle(runtime: Any, reqs: Sequence[Any], cap: int, depth: int, mtp: bool) -> tuple[Cycle, mx.array]:
    """A cycle of caches of `cap` slots for `reqs` (left-padded rows, each request's own policy) and its
    padded [G, W] prompt array.

    Raises:
        ValueError: rows of greedy and sampled kinds together (they prefill under different policies).
    """
    width = max(len(r.prompt) for r in reqs)
    pads = [width - len(r.prompt) for r in reqs]
    cache = runtime.make_cache(pads, ragged=True, capacity=cap)
    head = runtime.make_head_cache(pads, ragged=True, capacity=cap, depth=max(depth, 1)) if mtp else None
    greedy = [r.sampler.greedy and not r.sampler.has_penalties for r in reqs]
    if all(greedy):
        policy: Any = GreedyPolicy([r.sampler for r in reqs])
    elif not any(greedy):
        policy = SampledPolicy([r.sampler for r in reqs], row_seeds=[r.seed for r in reqs])
    else:
        raise ValueError("a prefill group holds greedy and sampled rows together")
    cyc = Cycle(runtime, policy, cache, head, depth, per_stream=mtp,
                logprobs=any(r.logprobs is not None for r in reqs))
    padded = mx.array([[0] * pad + list(r.prompt) for pad, r in zip(pads, reqs)], dtype=mx.int32)
    return cyc, padded


def group_rows(cyc: Cycle, tokens: mx.array, info: mx.array | None) -> Rows:
    """The rows a finished group prefill left in its cycle's caches, unpadded (evaluated)."""
    rows = Rows(RowState.take_unpadded(cyc.caches()), tokens, info, getattr(cyc.policy, "counts", None))
    mx.eval(rows.arrays())
    RowState.release(cyc.caches())
    return rows


def row_parts(reqs: Sequence[Any]) -> list[tuple[Rows, mx.array | None]]:
    """`merge_rows` parts of joining requests, in order: a request's own rows whole, a group's rows by index
    (consecutive members of one group as one part)."""
    parts: list[tuple[Rows, list[int] | None]] = []
    for r in reqs:
        if r.row_index is None:
            parts.append((r.row, None))
        elif parts and parts[-1][0] is r.row and parts[-1][1] is not None:
            parts[-1][1].append(r.row_index)
        else:
            parts.append((r.row, [r.row_index]))
    return [(rows, None if idx is None else mx.array(idx, dtype=mx.int32)) for rows, idx in parts]


__all__ = ["group_cycle", "group_rows", "row_parts"]
