"""`Engine`: the continuous-batching loop (admit, prefill a chunk, recompose, one cycle).

What each step does and the memory rules: the package docstring (`mtplx_ext.batching`).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext._checks import as_int
from mtplx_ext.cache.ragged import check_kv_quantization
from mtplx_ext.batching import admission, constrained
from mtplx_ext.batching.prefill import PrefillPhase, row_parts
from mtplx_ext.batching.batch import Batch, Rows, batch_streams, merge_rows
from mtplx_ext.batching.depths import engine_depths
from mtplx_ext.batching.metrics import snapshot
from mtplx_ext.batching.options import EngineOptions
from mtplx_ext.batching.prefix_cache import PrefixCache
from mtplx_ext.batching.requests import Event, Request
from mtplx_ext.batching.rows import RowRecord
from mtplx_ext.batching.rules import RequestRules
from mtplx_ext.batching.scheduler import BatchShape, needs_rebuild, plan_batch
from mtplx_ext.batching.steps import CycleRun, Recomposition, StepLog, StepResult
from mtplx_ext.batching.runner import EngineThread
from mtplx_ext.batching.token_logprobs import cycle_entries
from mtplx_ext.decode import session
from mtplx_ext.decode.results import BatchedDecodeResult
from mtplx_ext.decode.streams import InvalidRow, Streams
from mtplx_ext.sampling import SamplerConfig


class Engine(PrefillPhase):
    """A continuous-batching MTP decoding engine over one running batch.

    Args:
        runtime: an `MTPRuntime`: an attention-only trunk, or a GatedDeltaNet
            hybrid (`qwen3_next`, `qwen3_5`), whose streams commit per stream
            from the recurrent states captured at each verified position.
        options: the engine's settings (`options.EngineOptions`); or give them as keywords of the same names
            (`max_batch=`, `depth=`, ...: `**settings`), not both.
        tokenizer: with `decode(ids)`, for text and stop strings (default:
            the runtime's).

    Attributes:
        options: the settings it runs with.
        launch_ahead, compact_rows: the options' switches (either may be changed between steps).

    Raises:
        ValueError / TypeError: naming a bad argument; a trunk with
            recurrent layers other than GatedDeltaNet ones is refused (their
            state cannot be captured per position).
    """

    def __init__(self, runtime: Any, options: EngineOptions | None = None, *, tokenizer: Any = None,
                 **settings: Any):
        o = self.options = EngineOptions.given(options, settings)
        self.rt = runtime
        self._kv = None if o.kv_bits is None else check_kv_quantization(o.kv_bits, o.kv_group_size)
        self.max_batch = as_int("max_batch", o.max_batch, lo=1, hi=1 << 16)
        self.mtp, self.depth, self._route, self._depths = engine_depths(
            runtime, bool(o.use_mtp), o.depth, self.max_batch, self.per_batch_depth)
        self.cycle_depth = self.depth  # the running batch's K (self.depth: the deepest a batch may run)
        self._rechoose = False  # the acceptance seen moved K: recompose the batch at the new K
        default_ctx = admission.model_context(runtime)
        self.context = as_int("context", o.context if o.context is not None else default_ctx, lo=2)
        self.max_kv_slots = as_int("max_kv_slots", o.max_kv_slots if o.max_kv_slots is not None
                                   else self.max_batch * admission.capacity(self.context), lo=1)
        self.prefill_chunk = as_int("prefill_chunk", o.prefill_chunk, lo=1)
        self.launch_ahead, self.compact_rows = bool(o.launch_ahead), bool(o.compact_rows)
        self.prefix = PrefixCache.for_runtime(runtime, o.prefix_cache_bytes, o.prefix_cache_dir,
                                              o.prefix_cache_disk_bytes, o.prefix_block_tokens)
        self._prefix_ok = self.prefix.max_bytes > 0 and PrefixCache.supported(runtime)
        tok = tokenizer if tokenizer is not None else getattr(runtime, "tokenizer", None)
        self.tokenizer = tok if o.detokenize else None
        self.vocab = int(runtime.vocab_size)
        self.rules = RequestRules(self.vocab, self.depth, self.mtp, self.context, self.max_kv_slots,
                                  self.tokenizer)
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[RowRecord | None] = queue.SimpleQueue()
        self._rng = np.random.default_rng()
        # Engine-thread state: the records of the requests (`rows.RowRecord`), the clients' handles are theirs.
        self._waiting: deque[RowRecord] = deque()
        self._ready: list[RowRecord] = []  # prefilled, not merged yet
        self._live: list[RowRecord] = []  # rows of the running batch, in order
        self._batch: Batch | None = None
        self._batches: dict[BatchShape, Batch] = {}
        self._next: mx.array | None = None  # [B, K + 1] (x0, drafts) or [B, 1]
        self._inflight: Any = None  # a cycle launched ahead, its bundle not read yet
        self._info: mx.array | None = None
        self._streams: Streams | None = None
        self._guide: Any = None  # the running batch's constraints (`batching.constrained`), or None
        self._log = StepLog()  # what the step under way did (`step`'s result)
        self.cycle_count = 0
        self.stats = BatchedDecodeResult(depth=self.depth if self.mtp else 0)
        self.counters = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0, "prefill_tokens": 0,
                         "generated_tokens": 0, "recompositions": 0, "row_forwards": 0}
        self._step_end: float | None = None  # when the last step that decoded ended (`_time_step`)
        self._thread: EngineThread | None = None
        self._wired: Any = None

    def submit(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int = 64,
        sampler: SamplerConfig | None = None,
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] | str = (),
        seed: int | None = None,
        on_event: Callable[[Event], None] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
        depth: int | None = None,
    ) -> Request:
        """Queues a request; it is admitted at a later engine step.

        Args:
            prompt: token ids.
            max_tokens: cap on generated tokens.
            sampler: a `SamplerConfig` (None: greedy).
            stop_token_ids: tokens that end the request (kept).
            stop: strings that end the request (cut from its text; needs a tokenizer).
            seed: the sampled path's seed (None: a random one).
            on_event: called with each `Event` on the engine's thread (keep it short).
            logprobs: None, or alternatives per token (0..20): each token's logprob (`token_logprobs`).
            constraint: a `Constraint` (a grammar; `batching.constrained`), used by this request only.
            depth: most drafts a cycle commits for it, 0..K (0: one token per cycle); None: K.

        Raises:
            TypeError / ValueError: naming the bad argument; a request that
                could never fit (context or `max_kv_slots`).
        """
        rec = self.rules.request(next(self._ids), prompt, self._rng, max_tokens=max_tokens, sampler=sampler,
                                 stop_token_ids=stop_token_ids, stop=stop, seed=seed, on_event=on_event,
                                 logprobs=logprobs, depth=depth, constraint=constraint)
        self._inbox.put(rec)
        return rec.req

    # -- the engine thread -------------------------------------------------------

    def start(self) -> None:
        """Runs the engine on its own thread (every MLX call of the engine happens there)."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._thread = EngineThread(self, self._inbox)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0, reason: str = "the engine stopped") -> None:
        """Stops the engine thread; requests still open end with an error event saying `reason`."""
        if self._thread is None:
            return
        self._thread.stop(timeout, reason)
        self._thread = None
        self.prefix.flush()

    def release(self) -> None:
        """Gives the compiled steps of its batches back to the runtime (`Batch.release`), so that a later
        engine or decode of the same shapes replays them (a fixed batch ends this way); a later step builds
        its batches again.

        Raises:
            RuntimeError: requests are still open or the engine thread runs.
        """
        busy = self._live or self._ready or self._waiting or not self._inbox.empty() or self._inflight is not None
        if busy or self._thread is not None:
            raise RuntimeError("release needs an idle engine whose thread is stopped")
        for batch in self._batches.values():
            batch.release()
        self._batches.clear()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """The context `step` runs in (`start` enters it itself): fused attention, wired memory and, on hybrid
        trunks, mlx-lm's GatedDeltaNet routed through the capture op; process-wide, undone when the block ends."""
        with session.decode_session(self.rt, self._route, self._kv):
            yield

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Steps on the calling thread until no request is open (tests, offline use)."""
        with self.session():
            for _ in range(max_steps):
                if not self.step():
                    return
        raise RuntimeError(f"the engine did not become idle in {max_steps} steps")

    @property
    def live_streams(self) -> int:
        """Streams still decoding (finished rows may stay in the batch a while: `scheduler.needs_rebuild`)."""
        return sum(r.finish_reason is None for r in self._live)

    @property
    def batch_rows(self) -> int:
        """Rows of the running batch, finished ones not dropped yet included."""
        return len(self._live)

    @property
    def kv_slots(self) -> int:
        """KV slots the running batch holds (rows times capacity)."""
        return 0 if self._batch is None else self._batch.B * self._batch.cap

    @property
    def kv_bytes(self) -> int:
        """Bytes of the running batch's attention KV buffers (`Batch.kv_bytes`)."""
        batch = self._batch
        return 0 if batch is None else batch.kv_bytes

    def step(self) -> StepResult:
        """One engine step (admit, prefill a chunk, recompose, one cycle): what it did (`steps.StepResult`).

        The result is falsy when the engine is idle afterwards (nothing waiting, prefilling or decoding), so
        `while engine.step(): ...` steps until every request has ended.
        """
        for item in self.take_inbox():
            self.admit(item)
        self._drop_cancelled()
        self._prefill()
        if self._live or self._ready:
            self._recompose()
        if self._live:
            self._cycle()
        res = self._log.result(not (self._live or self._ready or self._waiting))
        self._time_step(res)
        return res

    def _time_step(self, res: StepResult) -> None:
        """A step that only decoded (after a step that did not idle) tells depth="auto" its wall time."""
        now = time.perf_counter()
        last, self._step_end = self._step_end, (None if res.idle or res.cycle is None else now)
        if (last is not None and self._depths is not None and res.cycle is not None and not res.prefill_tokens
                and res.recomposed is None):
            self._depths.time(res.cycle.rows, res.cycle.depth, now - last)

    # -- admission ---------------------------------------------------------------

    def take_inbox(self) -> list[RowRecord]:
        """The records of the requests submitted since the last look (without the stop marker)."""
        items: list[RowRecord] = []
        while not self._inbox.empty():  # (the common step: nothing new, no exception raised)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)
        return items

    def admit(self, r: RowRecord) -> None:
        """Queues a submitted request for prefill (engine thread)."""
        self._waiting.append(r)
        self.counters["submitted"] += 1
        self._log.admitted.append(r.id)

    def _drop_cancelled(self) -> None:
        for q in (self._waiting, self._ready) if self._waiting or self._ready else ():
            for r in [r for r in q if r.cancelled]:
                q.remove(r)
                self._finish(r, "cancelled")
        for r in self._live:
            if r.cancelled and r.finish_reason is None:
                self._finish(r, "cancelled")

    # -- the running batch -------------------------------------------------------

    def _recompose(self) -> None:
        """Runs the scheduler's `BatchPlan`: drops finished rows, merges prefilled ones into one compact batch."""
        if not (self._ready or self._rechoose) and all(r.finish_reason is None for r in self._live):
            return  # (the common step: nothing for `needs_rebuild` to weigh, no per-row records built)
        live, ready = [r.info() for r in self._live], [r.info() for r in self._ready]
        if not needs_rebuild(live, ready, self._rechoose, self.compact_rows):
            return
        self._rechoose = False
        drained = self._inflight is not None
        if drained:
            # The cycle launched ahead ran on the old rows: commit it first.
            p, self._inflight = self._inflight, None
            self._read(p)
            live, ready = [r.info() for r in self._live], [r.info() for r in self._ready]
        depth_for = self._depths if self._depths else (lambda rows: self.depth)
        plan = plan_batch(live, ready, True, self.mtp, depth_for)
        if self._batch is not None:  # finished replies, for the next turn's prompt
            self.prefix.store_finished(self._live, self._batch.caches())
        new = [self._ready[i] for i in plan.join]
        reqs = [self._live[i] for i in plan.keep] + new
        self._log.recomposed = Recomposition(
            tuple(self._live[i].id for i in plan.keep), tuple(r.id for r in new),
            tuple(r.id for i, r in enumerate(self._live) if i not in plan.keep),
            None if plan.shape is None else plan.shape.depth, drained)
        self._ready = []
        old = self._batch.unload(self._next, self._info) if self._batch is not None else None
        self._batch = None
        self._live = reqs
        self.counters["recompositions"] += 1
        if plan.shape is None:
            self._next = self._info = self._guide = None
            self._streams = None
            return
        shape = plan.shape
        self.stats.compactions += len(plan.keep) < len(live)
        parts: list[tuple[Rows, mx.array | None]] = [(old, mx.array(plan.keep, dtype=mx.int32))] if plan.keep else []
        parts += row_parts(new)
        for r in new:
            r.row = r.row_index = None
        K = self.cycle_depth = shape.depth
        rows = merge_rows(parts, shape.capacity, shape.kind, self.mtp, self.vocab, K)
        batch = self._batches.get(shape)
        if batch is None:
            batch = self._batches[shape] = Batch(self.rt, shape, self.mtp)
        batch.load(rows, reqs)
        self._batch = batch
        self._next, self._info = rows.next, rows.info
        self._guide, self._next, self._info = constrained.recomposed(
            reqs, batch.policy, self.vocab, K + 1 if self.mtp else 1, self.mtp, self._next, self._info)
        self.stats.host_syncs += self._guide is not None and self.mtp  # (the read of the rows' drafts)
        pending = [r for r in new if r.first is not None]
        if pending:  # the first cycle goes to the device first, then the joining rows' first tokens are read
            self._inflight = self._launch()
            mx.async_eval(self._inflight.bundle)
            self._deliver_firsts(pending)
        self._streams = batch_streams(reqs, self.vocab, K if self.mtp else 0, self.mtp, self.stats)

    per_batch_depth = True  #: depth="auto" picks K per batch size (LockstepEngine: one K agreed by the ranks)

    def _launch(self) -> Any:
        """Launches the running batch's next cycle (device work only)."""
        batch, step = self._batch, self.cycle_count + 1
        if self.mtp:
            extra = () if self._info is None else (self._info,)
            p = batch.cycle.launch("stream", step, batch.cap, self._next, *extra)
            self._next, self._info = p.next_tokens, p.next_info
        else:
            p = batch.cycle.launch("plain", step, batch.cap, self._next)
            self._next = p.bundle
        self.cycle_count = step
        return p

    def _cycle(self) -> None:
        """Reads one cycle, after launching the one after it when the batch may stay as it is.

        The next cycle depends only on device arrays (per-stream commit, plain picks), so it runs while the host
        reads this one's bundle and streams the tokens out; a row that finishes meanwhile wastes its share of it.
        Then the acceptance seen so far may move K (`batching.depths`): the next step recomposes the batch.
        """
        try:
            p, self._inflight = self._inflight, None
            if p is None:  # (the device starts on it while the host builds the next one)
                p = self._launch()
                mx.async_eval(p.bundle)
            # Unless this cycle may end every stream at its cap.
            if self.launch_ahead and self._guide is None and not self._streams.may_all_finish():
                self._inflight = self._launch()
                mx.async_eval(self._inflight.bundle)
        except Exception as e:  # noqa: BLE001 - the batch's state is unknown: fail its rows
            self._fail_batch(e)
            return
        if self._read(p):
            self._log.cycle = CycleRun(self.cycle_depth if self.mtp else 0, len(self._live))
        if self._depths is not None and self._live and self._depths.observe(
                self.stats.reached, self.stats.accepted_at, len(self._live), self.cycle_depth):
            self._rechoose = True

    def _fail_batch(self, e: BaseException) -> None:
        for r in self._live:
            self._fail(r, e)
        if self._batch is not None:
            self._batch.unload(None, None)
        self._batch, self._live, self._next, self._info, self._inflight = None, [], None, None, None

    def _read(self, p: Any) -> bool:
        """The cycle's one host read, then each live stream's commit; False when it was no decode cycle (it
        failed, or it was launched ahead after every row had finished)."""
        st, reqs = self._streams, self._live
        try:  # one wait: the logprobs (if any) and a constrained batch's next tokens come with the bundle
            extra = [p.logprobs] if p.logprobs is not None else []
            if self._guide is not None and p.next_tokens is not None:
                extra.append(p.next_tokens)
            t = time.perf_counter()
            mx.eval(p.bundle, *extra)
            b, lp = np.array(p.bundle), None if p.logprobs is None else np.array(p.logprobs)
            self.stats.sync_wait_s += time.perf_counter() - t
        except Exception as e:  # noqa: BLE001
            self._fail_batch(e)
            return False
        live = constrained.live_rows(reqs, st)
        if not any(live):  # a cycle launched ahead after every row had finished: wasted, not a decode cycle
            return False
        self.stats.cycles += 1
        self.stats.forwards += 1
        self.stats.host_syncs += 1
        # Rows the forward computed, finished ones not yet evicted included.
        self.counters["row_forwards"] += len(reqs)
        for i, r in enumerate(reqs):
            if r.finish_reason is not None or st.done[i]:
                continue
            try:
                dropped = bool(st.x0_committed[i])
                _, new, reason = (st.decide_stream if self.mtp else st.decide_plain_stream)(b, i)
            except Exception as e:  # noqa: BLE001
                st.done[i] = True
                self._fail(r, RuntimeError(e.detail) if isinstance(e, InvalidRow) else e)
                continue
            r.req.cycles += 1
            n = int(b[i, 1]) if self.mtp else None
            self._commit_host(r, new, reason, lp=cycle_entries(r, lp, i, n, dropped, len(new)))
        if self._guide is not None:
            still = constrained.live_rows(reqs, st)  # the rows' next mask; forced drafts go into the next tokens
            self._next, self._info = constrained.after_cycle(self._guide, self._batch.policy, p, b, live, still, self.mtp,
                                                             self._next, self._info)
        return True

    # -- host side of a request ---------------------------------------------------

    def _commit_host(self, r: RowRecord, new: list[int], reason: str | None, valid: bool = True,
                     lp: Any = None) -> None:
        """Delivers what request r committed to its handle (tokens, text, logprobs, its "tokens" event), and its
        end when `reason` (or a stop string) ends it."""
        if not valid:
            self._fail(r, RuntimeError(f"request {r.id}: invalid first token (non-finite logits)"))
            return
        self.counters["generated_tokens"] += len(new)
        self._log.commit(r.id, len(new))
        text = ""
        if r.detok is not None:
            text, cut = r.detok.push(new, final=reason is not None)
            if cut:
                reason = "stop"
        try:
            r.req.commit(new, text, lp)
        except Exception as e:  # noqa: BLE001 - a failing callback fails its request only
            self._fail(r, e)
            return
        if reason is not None:
            self._finish(r, reason)

    def _finish(self, r: RowRecord, reason: str) -> None:
        if r.finish(reason):
            self.counters["cancelled" if reason == "cancelled" else "finished"] += 1
            self._log.finished.append(r.id)

    def _fail(self, r: RowRecord, e: BaseException) -> None:
        if r.fail(str(e) or type(e).__name__):
            self.counters["failed"] += 1
            self._log.finished.append(r.id)

    def fail_all(self, why: str) -> None:
        """Ends every open request with an error event (engine thread)."""
        for r in list(self._waiting) + self._ready + self._live:
            if not r.done:
                self._fail(r, RuntimeError(why))
        for item in self.take_inbox():
            self._fail(item, RuntimeError(why))

    def metrics(self) -> dict[str, Any]:
        """Counters and MTP statistics (`batching.metrics.snapshot`; safe to read from handler threads)."""
        return snapshot(self, waiting=len(self._waiting), depths=None if self._depths is None else self._depths.depths)


__all__ = ["Engine"]
