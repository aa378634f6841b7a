"""One running batch shape of the engine: caches, policy and compiled cycle, loaded with rows.

A `Batch` of a given (rows, capacity, policy kind) is built and traced once
and replayed whenever the running batch has that shape again: streams' rows
(`Rows`) are loaded into its caches and policy, not rebuilt. `merge_rows`
builds the rows of a recomposed batch from the rows that go on and the newly
prefilled ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from mtplx_ext.batching.metrics import kv_bytes
from mtplx_ext.batching.scheduler import BatchShape
from mtplx_ext.batching.rows import RowRecord
from mtplx_ext.cache.rows import RowState, concat_rows
from mtplx_ext.decode.constraint import mask_words
from mtplx_ext.decode.cycle import Cycle
from mtplx_ext.decode.policies import GreedyPolicy, SampledPolicy
from mtplx_ext.decode.streams import Streams
from mtplx_ext.sampling import MAX_LOGIT_BIAS


@dataclass
class Rows:
    """Streams' device state between batches.

    Attributes:
        cache: their cache rows (trunk and head caches, in `Cycle.caches` order).
        next: [B, K + 1] (x0, drafts) of their next cycle, or [B, 1] plain.
        info: [B, K, V] draft logits of the next cycle (sampled MTP), or None.
        counts: [B, V] int32 penalty counts, or None.
    """

    cache: RowState
    next: mx.array
    info: mx.array | None = None
    counts: mx.array | None = None

    @classmethod
    def prefilled(cls, cyc: Cycle, tokens: mx.array, info: mx.array | None, wait: bool = True) -> "Rows":
        """The rows a finished prefill left in its cycle's caches (evaluated; or only launched with `wait`
        False)."""
        rows = cls(RowState.take(cyc.caches()), tokens, info, getattr(cyc.policy, "counts", None))
        (mx.eval if wait else mx.async_eval)(rows.arrays())
        return rows

    def arrays(self) -> list[mx.array]:
        """Every array of the rows (to evaluate them)."""
        extra = [a for a in (self.info, self.counts) if a is not None]
        return [*self.cache.arrays(), self.next, *extra]


def one_hot_info(nxt: mx.array, vocab: int) -> mx.array:
    """Draft logits for greedy-drafted rows joining a sampled batch: their argmax is the draft.

    A greedy row's verification only uses where q's mass is, so the draft it
    made by argmax keeps its exact verdict.
    """
    d = nxt[:, 1:]
    hot = mx.arange(vocab)[None, None, :] == d[:, :, None]
    return mx.where(hot, 0.0, -30.0).astype(mx.float32)


def fit_drafts(nxt: mx.array, info: mx.array | None, depth: int, vocab: int) -> tuple[mx.array, mx.array | None]:
    """Rows' (x0, drafts) [B, K' + 1] and draft logits [B, K', V] cut or padded to `depth` drafts.

    A batch of another K verifies the first `depth` drafts. Padded drafts
    are token 0 with one-hot draft logits (`one_hot_info`): a greedy row
    accepts one only where it is the target's own token, a sampled row with
    probability p(0) and resamples from p without it otherwise, so both stay
    exact; they only cost the one cycle's chance of accepting them.
    """
    have = nxt.shape[1] - 1
    if have >= depth:
        return nxt[:, : depth + 1], None if info is None else info[:, :depth]
    nxt = mx.concatenate([nxt, mx.zeros((nxt.shape[0], depth - have), nxt.dtype)], axis=1)
    if info is not None:
        info = mx.concatenate([info, one_hot_info(nxt, vocab)[:, have:].astype(info.dtype)], axis=1)
    return nxt, info


def merge_rows(parts: Sequence[tuple[Rows, mx.array | None]], capacity: int, kind: str, mtp: bool, vocab: int,
               depth: int | None = None) -> Rows:
    """The rows of a recomposed batch: (rows, indices or None for all) in order.

    Rows without draft logits get one-hot ones when the batch samples, rows
    without penalty counts get zero counts when it has penalties; with MTP,
    every row's drafts are fit to `depth` (`fit_drafts`).
    """
    if mtp and depth is not None:
        parts = [(replace(d, **dict(zip(("next", "info"), fit_drafts(d.next, d.info, depth, vocab)))), idx)
                 for d, idx in parts]

    def cat(get: Callable[[Rows], mx.array]) -> mx.array:
        return concat_rows(parts, get)

    cache = RowState.gather([(d.cache, idx) for d, idx in parts], capacity)
    info = None
    if mtp and kind != "greedy" and depth != 0:
        info = cat(lambda d: d.info if d.info is not None else one_hot_info(d.next, vocab))
    counts = None
    if kind == "penalties":
        counts = cat(
            lambda d: d.counts if d.counts is not None else mx.zeros((d.next.shape[0], vocab), mx.int32)
        )
    return Rows(cache=cache, next=cat(lambda d: d.next), info=info, counts=counts)


def prefill_cycle(runtime: Any, r: RowRecord, cap: int, depth: int, mtp: bool) -> Cycle:
    """A one-row cycle (caches of `cap` slots, the request's own policy) to prefill `r` in."""
    cache = runtime.make_cache([0], ragged=True, capacity=cap)
    head = runtime.make_head_cache([0], ragged=True, capacity=cap, depth=max(depth, 1)) if mtp else None
    s = r.sampler
    policy: Any = GreedyPolicy([s]) if s.greedy and not s.has_penalties else SampledPolicy(s, row_seeds=[r.seed])
    return Cycle(runtime, policy, cache, head, depth, per_stream=mtp, logprobs=r.logprobs is not None)


def batch_streams(reqs: Sequence[RowRecord], vocab: int, depth: int, mtp: bool, stats: Any) -> Streams:
    """Host bookkeeping of a recomposed batch: each request's caps, stops and what it committed so far.

    A request whose x0 went out at its prefill has its first bundle's x0
    left out (`Streams.resume`); acceptance is recorded into the engine's
    totals (`stats`) and each request's own statistics.
    """
    st = Streams(len(reqs), vocab, [r.max_tokens for r in reqs], [r.stop_ids for r in reqs], None, depth, mtp, 0)
    st.resume([len(r.tokens) for r in reqs], [r.x0_committed for r in reqs])
    for r in reqs:
        r.x0_committed = False
    st.result = stats
    st.row_stats = [r.stats for r in reqs]
    st.row_depth[:] = [min(r.depth, depth) for r in reqs]
    return st


class Batch:
    """Caches, policy and compiled cycle of one (rows, capacity, kind): loaded, run, unloaded.

    Args:
        runtime: the `MTPRuntime`.
        shape: what the batch is built for (`scheduler.BatchShape`): with a
            logit bias the policy holds a [B, MAX_LOGIT_BIAS] bias (rows
            without one pad it), a fixed shape for the compiled steps; with
            logprobs every cycle computes them (`Cycle(logprobs=True)`);
            `capped`: rows may accept fewer drafts than K (each its
            request's `depth`, `Cycle.row_depth`).
        mtp: MTP decoding (False: plain).
    """

    def __init__(self, runtime: Any, shape: BatchShape, mtp: bool):
        B, cap, kind, depth = shape.rows, shape.capacity, shape.kind, shape.depth
        self.B, self.cap, self.kind, self.shape = B, cap, kind, shape
        width = MAX_LOGIT_BIAS if shape.biased else None
        pads = [0] * B
        self.cache = runtime.make_cache(pads, ragged=True, capacity=cap)
        # (At K = 0 the head's caches only carry the rows' head state between batches.)
        self.head_cache = runtime.make_head_cache(pads, ragged=True, capacity=cap, depth=max(depth, 1)) if mtp else None
        if kind == "greedy":
            self.policy: Any = GreedyPolicy.slots(B, width)
        else:
            self.policy = SampledPolicy.slots(B, int(runtime.vocab_size), penalties=kind == "penalties",
                                              bias_width=width)
        if shape.masked:  # constrained rows: the mask is an input of the compiled steps
            self.policy.mask = mx.full((B, depth + 1 if mtp else 1, mask_words(runtime.vocab_size)), -1, mx.int32)
        self.cycle = Cycle(runtime, self.policy, self.cache, self.head_cache, depth, per_stream=mtp,
                           logprobs=shape.logprobs)
        if shape.capped:
            self.cycle.row_depth = mx.full((B,), depth, dtype=mx.int32)
        self.compiled = False
        self.kv_bytes = 0

    def caches(self) -> list[list]:
        return self.cycle.caches()

    def load(self, rows: Rows, reqs: Sequence[RowRecord]) -> None:
        """Makes this batch hold the rows of `reqs` (compiling its steps the first time)."""
        rows.cache.load_into(self.caches(), self.B, self.cap)
        self.kv_bytes = kv_bytes(self.caches())  # what the loaded rows' KV buffers hold (`Engine.kv_bytes`)
        if self.cycle.row_depth is not None:
            self.cycle.row_depth = mx.array([r.depth for r in reqs], dtype=mx.int32)
        self.policy.load_rows(
            [r.seed for r in reqs], [r.sampler for r in reqs], [r.step_off for r in reqs], rows.next[:, 0], rows.counts
        )
        if not self.compiled:
            self.cycle.compile_steps()
            self.compiled = True

    def release(self) -> None:
        """Gives its compiled steps back to the runtime (`Cycle.release`): a later batch of the same shape, in
        this engine or another, replays them instead of tracing again. The batch must be unloaded."""
        if self.compiled:
            self.cycle.release()
            self.compiled = False

    def unload(self, nxt: mx.array | None, info: mx.array | None) -> Rows:
        """The device rows (with the next cycle's tokens and draft logits); drops this batch's references."""
        cache = RowState.take(self.caches())
        counts = self.policy.unload_rows()
        RowState.release(self.caches())
        return Rows(cache=cache, next=nxt, info=info, counts=counts)


__all__ = ["Batch", "Rows", "batch_streams", "merge_rows", "one_hot_info", "prefill_cycle"]
