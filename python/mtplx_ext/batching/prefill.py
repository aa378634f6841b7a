"""Prefill of requests that start together: one left-padded forward, then one unpadded row each.

Requests arriving together (a fixed batch, a wave of clients) would cost one
prompt forward each if prefilled alone; here their whole prompts go through
one [G, W] forward (each left-padded to the longest, as a fixed batch's
prefill does), and each leaves with its own row of device state starting at
slot 0 (the padding's keys are never stored in the row:
`RaggedPositions.move_rows_left`), exactly the row its prefill alone
would have left. Each row draws from its own request's seed and
sampler (a row's draws never depend on its neighbours), so x0 and the first
drafts are those of the request prefilled alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext.batching import admission, constrained
from mtplx_ext.batching.batch import Rows, prefill_cycle
from mtplx_ext.batching.rows import RowRecord
from mtplx_ext.batching.scheduler import Waiting, plan_prefill
from mtplx_ext.batching.token_logprobs import prefill_entry
from mtplx_ext.cache.rows import RowState
from mtplx_ext.decode.constraint import RowConstraints
from mtplx_ext.decode.cycle import Cycle
from mtplx_ext.decode.policies import GreedyPolicy, SampledPolicy


def group_cycle(runtime: Any, reqs: Sequence[Any], cap: int, depth: int, mtp: bool
                ) -> tuple[Cycle, mx.array]:
    """A cycle of caches of `cap` slots for `reqs` (left-padded rows, each request's own policy) and its
    padded [G, W] prompt array. The KV layers keep each row's first real token at slot 0
    (`RaggedPositions.move_rows_left`): the rows leave as a batch's rows start, without a shift.

    Raises:
        ValueError: rows of greedy and sampled kinds together (they prefill under different policies).
    """
    width = max(len(r.prompt) for r in reqs)
    pads = [width - len(r.prompt) for r in reqs]
    cache = runtime.make_cache(pads, ragged=True, capacity=cap)
    head = runtime.make_head_cache(pads, ragged=True, capacity=cap, depth=max(depth, 1)) if mtp else None
    positions = {id(c.positions): c.positions for cl in (cache, head or []) for c in cl if hasattr(c, "positions")}
    for p in positions.values():
        p.move_rows_left(pads)
    greedy = [r.sampler.greedy and not r.sampler.has_penalties for r in reqs]
    if all(greedy):
        policy: Any = GreedyPolicy([r.sampler for r in reqs])
    elif not any(greedy):
        policy = SampledPolicy([r.sampler for r in reqs], row_seeds=[r.seed for r in reqs])
    else:
        raise ValueError("a prefill group holds greedy and sampled rows together")
    cons = [getattr(r, "constraint", None) for r in reqs]
    if any(c is not None for c in cons):  # each constrained row's x0 is masked by its own grammar
        policy.mask = RowConstraints(cons, int(runtime.vocab_size), depth + 1 if mtp else 1).current()
    cyc = Cycle(runtime, policy, cache, head, depth, per_stream=mtp,
                logprobs=any(r.logprobs is not None for r in reqs))
    padded = mx.array([[0] * pad + list(r.prompt) for pad, r in zip(pads, reqs)], dtype=mx.int32)
    return cyc, padded


def group_rows(cyc: Cycle, tokens: mx.array, info: mx.array | None, wait: bool = True) -> Rows:
    """The rows a finished group prefill left in its cycle's caches, each starting at slot 0 (evaluated; or
    only launched with `wait` False)."""
    rows = Rows(RowState.take(cyc.caches()), tokens, info, getattr(cyc.policy, "counts", None))
    (mx.eval if wait else mx.async_eval)(rows.arrays())
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
    # A group's rows all, in order, are its rows whole (no gather).
    return [(rows, None if idx is None or idx == list(range(rows.next.shape[0])) else mx.array(idx, dtype=mx.int32))
            for rows, idx in parts]


class PrefillPhase:
    """The prefill phase of an `Engine` step (a base of `Engine`, on its state): runs the scheduler's
    `PrefillPlan`, each request alone (chunked, from a prefix-cache hit) or a group together, and leaves each
    prefilled request's first token out and its row ready to join the running batch."""

    def _prefill(self) -> None:
        """Runs the scheduler's `PrefillPlan` (`scheduler.plan_prefill`): each request alone, in arrival order."""
        if not self._waiting:  # the common step: nothing to plan (no per-row records built)
            return
        held = [r.info() for r in self._live if r.finish_reason is None] + [r.info() for r in self._ready]
        waiting = [Waiting(r.info(), len(r.prompt), None if r.prefill is None else len(r.prompt) - r.prefill_pos)
                   for r in self._waiting]
        plan = plan_prefill(waiting, held, bool(self._live), self.prefill_chunk, self.max_batch, self.max_kv_slots)
        works = list(plan.chunks)
        while works:
            n = 1
            while works[0].group is not None and n < len(works) and works[n].group == works[0].group:
                n += 1
            work, reqs = works[0], [self._waiting[i] for i in range(n)]  # the plan follows the queue
            del works[:n]
            # A group's prompts the prefix cache would resume prefill alone, from their hit.
            together = [r for r in reqs if not self.prefix.peek(r.prompt, self.rt, self._prefill_depth(1), self.mtp)
                        ] if n > 1 else []
            for r in reqs:  # alone: a request's next chunks, or a group's prefix-cache hits
                if r not in together:
                    self._prefill_alone(r, work.chunks if n == 1 else len(r.prompt), work.start)
            if together:
                for r in together:
                    self._waiting.remove(r)
                self._prefill_group(together)

    def _prefill_alone(self, r: RowRecord, chunks: int, start: bool) -> None:
        """Forwards up to `chunks` chunks of r's prompt (starting its prefill first); r leaves the queue when done."""
        try:
            if start:
                self._start_prefill(r)
            gen, cyc = r.prefill
            for _ in range(chunks):
                tokens = min(self.prefill_chunk, len(r.prompt) - r.prefill_pos)  # what this next() forwards
                self.counters["prefill_tokens"] += tokens
                self._log.prefill(r.id, tokens)
                try:
                    next(gen)
                    r.prefill_pos += tokens
                    self.prefix.checkpoint(r.prompt, r.prefill_pos, cyc.caches())  # (hybrid trunks' states)
                except StopIteration as done:  # (a prefix-cache hit can end it before the plan's chunks)
                    self._waiting.remove(r)
                    self._finish_prefill(r, cyc, *done.value)
                    return
        except Exception as e:  # noqa: BLE001 - one request fails, the engine goes on
            if r in self._waiting:
                self._waiting.remove(r)
            self._fail(r, e)

    def _prefill_group(self, reqs: list[RowRecord]) -> None:
        """Prefills whole prompts together in one left-padded forward (`batching.prefill`)."""
        try:
            k = self._prefill_depth(len(reqs))
            cap = admission.capacity(max(r.need for r in reqs))
            cyc, padded = group_cycle(self.rt, reqs, cap, k, self.mtp)
            self.counters["prefill_tokens"] += sum(len(r.prompt) for r in reqs)
            for r in reqs:
                self._log.prefill(r.id, len(r.prompt))
            tokens, info = cyc.prefill(padded)
            defer = all(self._defers(r) for r in reqs)
            rows = group_rows(cyc, tokens, info, wait=not defer)
        except Exception as e:  # noqa: BLE001 - the group's requests fail, the engine goes on
            for r in reqs:
                self._fail(r, e)
            return
        lps = cyc.prefill_logprobs
        x0s = [None] * len(reqs) if defer else np.array(tokens[:, 0]).tolist()  # (the group's one host read)
        for i, r in enumerate(reqs):
            self._finish_prefill(r, cyc, tokens, None, (rows, i), None if lps is None else lps[i:i + 1], x0s[i])

    def _prefill_depth(self, joining: int) -> int:
        """The K of the batch that prefilled rows would join (their first drafts)."""
        return self._depths.expected(len(self._live) + len(self._ready) + joining) if self._depths else self.depth

    def _start_prefill(self, r: RowRecord) -> None:
        cap = admission.capacity(r.need)
        k = self._prefill_depth(1)
        cyc = prefill_cycle(self.rt, r, cap, k, self.mtp)
        constrained.start_prefill(cyc, r, self.vocab, k + 1 if self.mtp else 1)
        r.prefill_from = self.prefix.resume(r.prompt, cyc.caches(), cap) if self._prefix_ok else 0
        r.req.cached_tokens = r.prefill_from
        steps = cyc.prefill_steps(mx.array([r.prompt], dtype=mx.int32), self.prefill_chunk, r.prefill_from)
        r.prefill, r.prefill_pos = (steps, cyc), r.prefill_from

    def _defers(self, r: RowRecord) -> bool:
        """Whether r's first token is read only once its batch's first cycle is launched (`_deliver_firsts`),
        not at the end of its prefill: the host then builds that batch while the device runs the prefill.
        Only where no one reads the token sooner (`EngineOptions.first_token_at_prefill` False), and not with
        a prefix cache (it stores the prompt with the token), a constraint (its grammar takes the token first)
        or a cap of one token (the request ends with it, never joining a batch)."""
        return (not self.options.first_token_at_prefill and self.prefix.max_bytes <= 0 and r.constraint is None
                and r.max_tokens > 1)

    def _finish_prefill(self, r: RowRecord, cyc: Cycle, tokens: mx.array, info: Any,
                        grouped: tuple[Rows, int] | None = None, packed_lp: Any = None, x0: int | None = None
                        ) -> None:
        """A prefilled request: its row ready to join (`grouped`: its row of a group's, `tokens` the group's) and
        its first token out, now or, when it `_defers`, after its batch's first launch. `x0`: the token, already
        read (a group reads its rows' in one read)."""
        r.prefill, defer = None, x0 is None and self._defers(r)
        if x0 is None and not defer:
            x0 = int(np.array(tokens)[0, 0])
        if grouped is None:
            if not defer:  # the prompt's positions, its last one's pair with x0
                self.prefix.store(r.prompt + [x0], cyc.caches())
            r.row, r.row_index = Rows.prefilled(cyc, tokens, info, wait=not defer), None
            packed_lp = cyc.prefill_logprobs
        else:  # (its prompt is stored with its reply when it finishes)
            r.row, r.row_index = grouped
        # The stream's own step count: its first verification (or plain pick) is step 1 (2) of a decode alone.
        r.step_off = self.cycle_count + 1 - (1 if self.mtp else 2)
        self._log.prefilled.append(r.id)
        if defer:
            r.first = (tokens, 0 if grouped is None else grouped[1], packed_lp)
            r.x0_committed = self.mtp
            self._ready.append(r)
            return
        self._deliver_first(r, x0, packed_lp)
        if r.finish_reason is not None:
            return
        r.x0_committed = self.mtp
        self._ready.append(r)

    def _deliver_first(self, r: RowRecord, x0: int, packed_lp: Any) -> None:
        """The prefill's token goes out (time to first token: the prefill), with MTP too: its first cycle's
        bundle then starts with it again. It may end the request (a stop token, a cap of one token)."""
        constrained.finish_prefill(r, x0, self.mtp)
        self._commit_host(r, [x0], "stop" if x0 in r.stop_ids else ("length" if r.max_tokens <= 1 else None),
                          valid=0 <= x0 < self.vocab, lp=prefill_entry(r, packed_lp))

    def _deliver_firsts(self, reqs: Sequence[RowRecord]) -> None:
        """The first tokens of rows that joined the batch before they were read (`_defers`), in one host read
        (the batch's first cycle already launched). A row its token ends stays in the batch, finished, until
        the scheduler drops it, as a row that finished in a cycle does."""
        arrays = {id(r.first[0]): r.first[0] for r in reqs}
        mx.eval(*arrays.values())
        host = {k: np.array(a) for k, a in arrays.items()}
        for r in reqs:
            (tokens, i, packed_lp), r.first = r.first, None
            self._deliver_first(r, int(host[id(tokens)][i, 0]), packed_lp)


__all__ = ["PrefillPhase", "group_cycle", "group_rows", "row_parts"]
