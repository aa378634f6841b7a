"""The engine's decisions as typed plans: plain Python (no MLX), so each rule is testable alone.

An engine step runs in two phases, each decided here and executed by the
`Engine` (the runner):

1. `plan_prefill`: which waiting requests start their prefill and how many
   prompt tokens each forwards this step (`PrefillPlan`);
2. `plan_batch`: after the prefills, whether the running batch is rebuilt,
   and as what: the rows that stay, the prefilled requests that join, and the
   shape of the new batch (`BatchPlan`, `BatchShape`).

The scheduler reads what it needs of each request through `RowInfo` (a frozen
record the runner builds from the request), never the request itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mtplx_ext.batching.admission import capacity, fits

#: Policy kinds of a batch, from the cheapest: greedy rows, sampled rows, sampled rows with penalty counts.
KINDS = ("greedy", "sampled", "penalties")


@dataclass(frozen=True)
class RowInfo:
    """What the scheduler knows of a request.

    Attributes:
        id: the request's id.
        need: KV slots it may use (`admission.request_need`).
        kind: its policy kind (one of `KINDS`).
        biased: it carries a logit bias.
        logprobs: it asked for logprobs.
        constrained: it carries a constraint (a grammar).
        depth: the most drafts a cycle may commit for it.
        finished: it ended (finished, cancelled or failed).
    """

    id: int
    need: int
    kind: str = "greedy"
    biased: bool = False
    logprobs: bool = False
    constrained: bool = False
    depth: int = 0
    finished: bool = False


@dataclass(frozen=True)
class BatchShape:
    """What a compiled batch is built for; batches of equal shapes are one (built and traced once).

    Attributes:
        rows: rows (B).
        capacity: KV slots per row.
        kind: the policy kind (one of `KINDS`).
        masked: some row carries a constraint mask (the mask is a step input).
        biased: some row has a logit bias (a [B, MAX_LOGIT_BIAS] input).
        logprobs: some row asked for logprobs (every cycle computes them).
        capped: some row accepts fewer drafts than `depth` (`Cycle.row_depth`).
        depth: drafts per cycle (K; 0: none).
    """

    rows: int
    capacity: int
    kind: str
    masked: bool
    biased: bool
    logprobs: bool
    capped: bool
    depth: int


@dataclass(frozen=True)
class PrefillChunk:
    """One request's prefill work of a step: `start` it first (caches, prefix lookup), then forward
    `chunks` chunks of the prompt (the last ones may finish it).

    `group`: consecutive entries of one group are whole prompts that start and finish together in one
    left-padded forward (requests arriving together cost one prefill, as a fixed batch's do); None: alone.
    """

    id: int
    start: bool
    chunks: int
    group: int | None = None


@dataclass(frozen=True)
class PrefillPlan:
    chunks: tuple[PrefillChunk, ...] = ()


@dataclass(frozen=True)
class BatchPlan:
    """A rebuilt running batch: `keep` (indices into the running rows) then `join` (indices into the prefilled
    requests), in that order; `shape` None when no row remains."""

    keep: tuple[int, ...]
    join: tuple[int, ...]
    shape: BatchShape | None


@dataclass(frozen=True)
class Waiting:
    """A request waiting for (or in) its prefill.

    Attributes:
        info: the request.
        remaining: prompt tokens it has still to forward (None: not started; its prefix-cache hit is not known
            before it starts, so its whole prompt counts).
        prompt: its prompt's length.
    """

    info: RowInfo
    prompt: int
    remaining: int | None = None


def kind_of(rows: Sequence[RowInfo]) -> str:
    """The policy kind a batch of these rows needs: the most demanding of theirs."""
    return max((r.kind for r in rows), key=KINDS.index, default="greedy")


def groupable(info: RowInfo) -> str | None:
    """The prefill group class of a request starting with its whole prompt in one chunk (None: alone).

    Greedy rows prefill under an argmax policy, the others under a sampled one (a constrained row's first
    token is masked by its own grammar's row of the group's mask).
    """
    return "greedy" if info.kind == "greedy" else "sampled"


def plan_prefill(waiting: Sequence[Waiting], held: Sequence[RowInfo], decoding: bool, chunk: int, max_batch: int,
                 max_kv_slots: int) -> PrefillPlan:
    """Prefill in arrival order: all that fit, or while streams decode at most `chunk` prompt tokens a step (a
    request's first chunk waits for a step with budget for it; short prompts go whole, so requests arriving
    together join together). Nothing overtakes a request that does not fit yet. Consecutive requests that
    start with their whole prompt in one chunk, of one `groupable` class, form a group (one forward).

    Args:
        waiting: the queue, oldest first.
        held: the rows the running batch keeps plus the prefilled requests not merged yet.
        decoding: some stream decodes (the prefill budget applies).
        chunk: prompt tokens per prefill chunk (and the step's budget while decoding).
    """
    budget = chunk if decoding else None
    needs = [r.need for r in held]
    out: list[PrefillChunk] = []
    last_cls: str | None = None
    size = width = 0  # the current group's rows and longest prompt
    for w in waiting:
        remaining = w.remaining
        start = remaining is None
        if start:
            if budget is not None and min(chunk, w.prompt) > budget:
                break
            if not fits(needs + [w.info.need], max_batch, max_kv_slots):
                break
            remaining = w.prompt
        n = 0
        while remaining > 0 and (budget is None or budget > 0):
            tokens = min(chunk, remaining)
            remaining -= tokens
            n += 1
            if budget is not None:
                budget -= tokens
        cls = groupable(w.info) if start and remaining == 0 and n == 1 else None
        group = None
        if cls is not None:
            prev = out[-1] if out else None
            # A group forwards its rows padded to the longest: at most `chunk` tokens in all.
            same = (prev is not None and prev.group is not None and last_cls == cls
                    and (size + 1) * max(width, w.prompt) <= chunk)
            group = prev.group if same else len(out)
            size, width = (size + 1, max(width, w.prompt)) if same else (1, w.prompt)
        last_cls = cls
        out.append(PrefillChunk(w.info.id, start, n, group))
        if remaining > 0:
            break  # the budget ran out inside it: the next step goes on with it
        needs.append(w.info.need)
        if budget is not None and budget <= 0:
            break
    return PrefillPlan(tuple(out))


def needs_rebuild(live: Sequence[RowInfo], ready: Sequence[RowInfo], rechoose: bool, compact: bool = True) -> bool:
    """Whether the running batch changes: a prefilled request waits to join, K should move, or at most half of
    the rows still decode.

    Finished rows stay in the batch until then (their share of a forward is wasted, their tokens ignored):
    dropping each as it ends would rebuild the batch at every finish and run as many batch shapes, each traced
    once; halving bounds both, as a fixed batch's compaction does. A row's tokens never depend on its neighbours,
    so when rows leave changes no token. `compact` False keeps finished rows until every row has finished.
    """
    if rechoose or any(not r.finished for r in ready):
        return True
    done = sum(r.finished for r in live)
    return done > 0 and (2 * done >= len(live) if compact else done == len(live))


def plan_batch(live: Sequence[RowInfo], ready: Sequence[RowInfo], rechoose: bool, mtp: bool,
               depth_for: Callable[[int], int]) -> BatchPlan | None:
    """The running batch rebuilt when rows finished, requests were prefilled, or K should change (`rechoose`);
    None when it stays as it is.

    Rows keep their order; prefilled requests join after them. The batch's K
    is `depth_for(rows)` (0 without MTP); its capacity fits its neediest row.
    """
    if not needs_rebuild(live, ready, rechoose):
        return None
    keep = tuple(i for i, r in enumerate(live) if not r.finished)
    join = tuple(i for i, r in enumerate(ready) if not r.finished)
    rows = [live[i] for i in keep] + [ready[i] for i in join]
    if not rows:
        return BatchPlan(keep, join, None)
    k = depth_for(len(rows)) if mtp else 0
    shape = BatchShape(
        rows=len(rows), capacity=capacity(max(r.need for r in rows)), kind=kind_of(rows),
        masked=any(r.constrained for r in rows), biased=any(r.biased for r in rows),
        logprobs=any(r.logprobs for r in rows), capped=mtp and any(r.depth < k for r in rows), depth=k,
    )
    return BatchPlan(keep, join, shape)


__all__ = ["KINDS", "BatchPlan", "BatchShape", "PrefillChunk", "PrefillPlan", "RowInfo", "Waiting", "groupable",
           "kind_of", "needs_rebuild", "plan_batch", "plan_prefill"]
