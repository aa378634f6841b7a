"""Continuous batching: `Engine` admits requests into one running MTP batch as they arrive.

Each engine step:

1. new requests and cancellations are taken from the inbox (any thread may
   submit; only the engine's own thread touches MLX);
2. waiting requests are prefilled alone (B = 1, `Cycle.prefill_steps`), one
   chunk of `prefill_chunk` tokens per step while other streams decode, so a
   long prompt never stalls them for its whole prefill;
3. the running batch is recomposed when a stream finished, was cancelled or
   a prefill completed: the rows that go on and the new ones are gathered
   into one compact batch (finished rows cost nothing afterwards), each at
   its own positions (per-stream end slots of `RaggedKVCache`); on hybrid
   trunks each row's recurrent and conv state (`ArraysCache`) moves with it;
4. one MTP cycle (`Cycle`'s compiled per-stream step: K drafts, one
   [B, K + 1] verification, per-stream commit) runs for all live streams,
   its bundle is read once, and each stream's committed tokens go out.

Hybrid trunks (`qwen3_next`, `qwen3_5`: GatedDeltaNet layers and attention
layers) commit per stream too: the verification runs through
`gated_delta.capture`, and each stream takes the recurrent state captured at
its own accepted length (no repair forward). The routing of mlx-lm's
GatedDeltaNet through the capture op is on, process-wide, while the engine
runs (`Engine.session`).

A batch of a given (rows, capacity, policy kind) is traced once and replayed
whenever the batch has that shape again: its arrays are loaded, not rebuilt.

Streams do not depend on each other: greedy rows are argmax decoding of
their own prompt, sampled rows draw from their own seed's key with their own
cycle count (`SampledPolicy.step_base`), so a request's tokens equal those
of decoding it alone.

Memory: at most `max_batch` live streams and `max_kv_slots` KV slots (rows
times the batch's slot capacity, the KV memory actually held). A request
that does not fit now waits; one that never could is refused at `submit`.
A recurrent layer holds a fixed-size state per row, so hybrids add memory
per row (bounded by `max_batch`), not per slot.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from mtplx_ext._checks import as_int, as_seed
from mtplx_ext.engine import bundle as chain
from mtplx_ext.engine.cycle import Cycle
from mtplx_ext.engine.generate import (
    _fused_attention,
    _gated_delta_trunk,
    _has_recurrent_layers,
    _route_recurrent,
    check_depth,
    check_prompts,
    check_stop_ids,
)
from mtplx_ext.engine.policies import GreedyPolicy, SampledPolicy
from mtplx_ext.engine.results import BatchedDecodeResult
from mtplx_ext.engine.streams import Streams
from mtplx_ext.ragged_cache import RaggedKVCache, RaggedPositions
from mtplx_ext.sampled import sampler_params
from mtplx_ext.sampling import SamplerConfig

#: KV capacities are rounded up to this many slots (fewer distinct traces).
KV_BLOCK = 128


@dataclass
class Event:
    """What a request emits: new tokens, its end, or its failure.

    Attributes:
        kind: "tokens", "done" or "error".
        tokens: newly committed token ids ("tokens").
        text: newly final text (with a tokenizer; stop strings cut it).
        finish_reason: "stop", "length" or "cancelled" ("done").
        error: the message ("error").
    """

    kind: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


class Request:
    """One submitted request; read its tokens as they are committed.

    Attributes:
        id: the engine's request number.
        prompt: prompt token ids.
        tokens: committed token ids so far.
        text: final text so far (with a tokenizer).
        finish_reason: None while running, else "stop", "length", "cancelled" or "error".
        error: the failure message, if any.
        cycles, drafted, accepted: MTP statistics of this request.
        submitted_s, first_token_s, finished_s: `time.perf_counter()` stamps.
    """

    def __init__(
        self,
        rid: int,
        prompt: list[int],
        sampler: SamplerConfig,
        max_tokens: int,
        stop_ids: frozenset[int],
        stop: tuple[str, ...],
        seed: int,
        on_event: Callable[[Event], None] | None,
    ):
        self.id = rid
        self.prompt = prompt
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.stop = stop
        self.seed = seed
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cycles = self.drafted = self.accepted = 0
        self.submitted_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self._on_event = on_event
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        # Engine-thread state.
        self.need = 0  # KV slots this request may use
        self.prefill: Any = None  # (generator, Cycle) while prefilling
        self.row: dict[str, Any] | None = None  # device row state once prefilled
        self.step_off = 0  # cycle the stream's own step count starts from
        # MTP: x0 went out at the prefill; the first cycle's bundle repeats it.
        self.x0_sent = False
        self._sent = 0  # characters of decoded text already final
        # Incremental detokenization: (token count, characters) where the
        # decoded text ends on a whole character, oldest first.
        self._marks: list[tuple[int, int]] = [(0, 0)]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Asks the engine to drop this request (its row is freed at the next step)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the request ends; False on timeout."""
        return self._done.wait(timeout)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Yields this request's events until its "done" or "error" (blocking).

        Raises:
            TimeoutError: no event for `timeout` seconds.
        """
        while True:
            try:
                ev = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no event for {timeout} s") from None
            yield ev
            if ev.kind in ("done", "error"):
                return

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per cycle of this request."""
        return self.accepted / self.cycles if self.cycles else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def _emit(self, ev: Event) -> None:
        self._events.put(ev)
        if self._on_event is not None:
            self._on_event(ev)
        if ev.kind in ("done", "error"):
            self.finished_s = time.perf_counter()
            self._done.set()


def _kind(reqs: Sequence[Request]) -> str:
    """The policy a batch of these requests needs."""
    if any(r.sampler.has_penalties for r in reqs):
        return "penalties"
    if any(not r.sampler.greedy for r in reqs):
        return "sampled"
    return "greedy"


#: Tokens decoded before an incremental detokenization window, as context.
_DETOK_CONTEXT = 4


def _capacity(need: int) -> int:
    return KV_BLOCK * -(-need // KV_BLOCK)


class _Batch:
    """Caches, policy and compiled cycle of one (rows, capacity, kind): loaded, run, unloaded."""

    def __init__(self, engine: "Engine", B: int, cap: int, kind: str):
        self.B, self.cap, self.kind = B, cap, kind
        rt = engine.rt
        pads = [0] * B
        self.cache = rt.make_cache(pads, ragged=True, capacity=cap)
        self.head_cache = rt.make_head_cache(pads, ragged=True, capacity=cap, depth=engine.depth) if engine.mtp else None
        if kind == "greedy":
            self.policy: Any = GreedyPolicy()
        else:
            self.policy = SampledPolicy([SamplerConfig()] * B, row_seeds=[0] * B)
            self.policy._setup(B, engine.vocab)
            self.policy._penalties = kind == "penalties"
        self.cycle = Cycle(rt, self.policy, self.cache, self.head_cache, engine.depth, per_stream=engine.mtp)
        self.compiled = False

    def caches(self) -> list[list]:
        return self.cycle.caches()

    def load(self, rows: dict[str, Any], reqs: Sequence[Request]) -> None:
        last = mx.full((self.B, 1), self.cap - 1, mx.int32)
        positions, kv, rec = _split(self.caches())
        for p, ends in zip(positions, rows["ends"]):
            p.load(ends, last)
        for c, (k, v) in zip(kv, rows["kv"]):
            c.keys, c.values = k, v
        for c, leaves in zip(rec, rows["rec"]):
            # Past its prompt: no padding mask (a compiled step binds it so).
            c.cache, c.left_padding, c.lengths = list(leaves), None, None
        if self.kind != "greedy":
            p = self.policy
            p._keys = mx.concatenate([_row_key(r.seed) for r in reqs], axis=0)
            p._params = sampler_params([r.sampler for r in reqs], self.B)
            p.step_base = mx.array([r.step_off % 2**32 for r in reqs], dtype=mx.uint32)
            p.x0 = rows["next"][:, 0]
            p.counts = rows["counts"] if self.kind == "penalties" else None
        if not self.compiled:
            self.cycle.compile_steps()
            self.compiled = True

    def unload(self) -> dict[str, Any]:
        """The device rows (and drops this batch's references to them)."""
        rows = _rows(self.caches())
        rows["counts"] = getattr(self.policy, "counts", None)
        _, kv, rec = _split(self.caches())
        for c in kv:
            c.keys = c.values = None
        for c in rec:
            c.cache = [None] * len(c.cache)
        if self.kind != "greedy":
            self.policy.counts = self.policy.x0 = None
        return rows


def _split(cache_lists: Sequence[Sequence[Any]]) -> tuple[list[RaggedPositions], list[RaggedKVCache], list[ArraysCache]]:
    """(the distinct shared positions, the KV layers, the recurrent layers) of cache lists, in layer order.

    Any layer may be recurrent (a hybrid's first layer often is), so the
    positions come from the KV layers, wherever they are.
    """
    positions: list[RaggedPositions] = []
    kv: list[RaggedKVCache] = []
    rec: list[ArraysCache] = []
    for i, caches in enumerate(cache_lists):
        for j, c in enumerate(caches):
            if isinstance(c, RaggedKVCache):
                kv.append(c)
                if all(p is not c.positions for p in positions):
                    positions.append(c.positions)
            elif isinstance(c, ArraysCache):
                rec.append(c)
            else:
                raise ValueError(f"Engine: cache layer {i}.{j} ({type(c).__name__}) is neither ragged KV nor recurrent")
    return positions, kv, rec


def _rows(cache_lists: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The device state of every row: per-stream ends, KV buffers, recurrent leaves."""
    positions, kv, rec = _split(cache_lists)
    return {
        "ends": [p.ends for p in positions],
        "kv": [(c.keys, c.values) for c in kv],
        "rec": [list(c.cache) for c in rec],
    }


def _row_key(seed: int) -> mx.array:
    # The same derivation as SampledPolicy._setup, so a row keeps its key in any batch.
    w = np.array([seed], dtype=np.uint64)
    raw = mx.array(np.stack([(w >> 32).astype(np.uint32), (w & 0xFFFFFFFF).astype(np.uint32)], axis=1))
    return mx.vmap(lambda k: mx.random.split(k, 2)[0])(raw)


def _fit_cap(a: mx.array, cap: int) -> mx.array:
    """[B, H, S, D] KV buffer with S slots cut or zero-padded to `cap`."""
    S = a.shape[2]
    if S == cap:
        return a
    if S > cap:
        return a[:, :, :cap]
    return mx.pad(a, [(0, 0), (0, 0), (0, cap - S), (0, 0)])


class Engine:
    """A continuous-batching MTP decoding engine over one running batch.

    Args:
        runtime: an `MTPRuntime`: an attention-only trunk, or a GatedDeltaNet
            hybrid (`qwen3_next`, `qwen3_5`), whose streams commit per stream
            from the recurrent states captured at each verified position.
        max_batch: most streams decoding at once.
        depth: drafts per cycle (K).
        use_mtp: False decodes plainly (one token per forward), the baseline.
        max_kv_slots: most KV slots held by the running batch (rows times
            its per-row capacity); default max_batch times the context.
        prefill_chunk: prompt tokens prefilled per engine step while other
            streams decode.
        tokenizer: with `decode(ids)`, for text and stop strings (default:
            the runtime's).
        context: most prompt + generated tokens of one request (default:
            the model's `max_position_embeddings`).

    Raises:
        ValueError / TypeError: naming a bad argument; a trunk with
            recurrent layers other than GatedDeltaNet ones is refused (their
            state cannot be captured per position).
    """

    def __init__(
        self,
        runtime: Any,
        *,
        max_batch: int = 8,
        depth: int = 1,
        use_mtp: bool = True,
        max_kv_slots: int | None = None,
        prefill_chunk: int = 256,
        tokenizer: Any = None,
        context: int | None = None,
    ):
        self.rt = runtime
        self.max_batch = as_int("max_batch", max_batch, lo=1, hi=1025)
        self.depth = check_depth(depth)
        self.mtp = bool(use_mtp)
        if self.mtp and not runtime.has_mtp:
            raise ValueError("use_mtp=True needs a runtime with MTP head weights (this one has none)")
        recurrent = _has_recurrent_layers(runtime)
        if recurrent and not _gated_delta_trunk(runtime):
            raise ValueError(
                f"Engine: the {getattr(runtime, 'model_type', '?')} trunk has recurrent layers that are not "
                "GatedDeltaNet layers; continuous batching of a hybrid needs the gated-delta capture "
                "(qwen3_next / qwen3_5 trunks) to commit and move each stream's recurrent state"
            )
        # As fixed-batch decoding decides: the capture for per-stream commit,
        # else only for runtimes that opted into fused CPU ops.
        self._route = recurrent and (self.mtp or bool(getattr(runtime, "cpu_ops_fused", False)))
        cfg = getattr(runtime, "config", {}) or {}
        default_ctx = int(cfg.get("max_position_embeddings", 4096))
        self.context = as_int("context", context if context is not None else default_ctx, lo=2)
        self.max_kv_slots = as_int(
            "max_kv_slots", max_kv_slots if max_kv_slots is not None else self.max_batch * _capacity(self.context), lo=1
        )
        self.prefill_chunk = as_int("prefill_chunk", prefill_chunk, lo=1)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(runtime, "tokenizer", None)
        self.vocab = int(runtime.vocab_size)
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._rng = np.random.default_rng()
        # Engine-thread state.
        self._waiting: deque[Request] = deque()
        self._ready: list[Request] = []  # prefilled, not merged yet
        self._live: list[Request] = []  # rows of the running batch, in order
        self._batch: _Batch | None = None
        self._batches: dict[tuple[int, int, str], _Batch] = {}
        self._next: mx.array | None = None  # [B, K + 1] (x0, drafts) or [B, 1]
        self._inflight: Any = None  # a cycle launched ahead, its bundle not read yet
        self._info: mx.array | None = None
        self._streams: Streams | None = None
        self.cycle_count = 0
        self.stats = BatchedDecodeResult(streams=[], depth=self.depth if self.mtp else 0,
                                         reached=[0] * self.depth, accepted_at=[0] * self.depth)
        self.counters = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0, "prefill_tokens": 0,
                         "generated_tokens": 0, "recompositions": 0, "row_forwards": 0}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wired: Any = None

    # -- submitting (any thread) ---------------------------------------------

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

        Raises:
            TypeError / ValueError: naming the bad argument; a request that
                could never fit (context or `max_kv_slots`).
        """
        if isinstance(prompt, (str, bytes)):
            raise TypeError("prompt must be a list of token ids, got a string (tokenize it first)")
        prompt = check_prompts([prompt], self.vocab)[0]
        max_tokens = as_int("max_tokens", max_tokens, lo=1)
        if sampler is None:
            sampler = SamplerConfig(temperature=0.0)
        if not isinstance(sampler, SamplerConfig):
            raise TypeError(f"sampler must be a SamplerConfig or None, got {type(sampler).__name__}")
        stop_ids = check_stop_ids(stop_token_ids, self.vocab)
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this engine has none)")
        seed = as_seed("seed", seed)
        if seed is None:
            seed = int(self._rng.integers(0, 2**63))
        if on_event is not None and not callable(on_event):
            raise TypeError("on_event must be callable or None")
        total = len(prompt) + max_tokens
        if total > self.context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context of "
                f"{self.context} tokens"
            )
        req = Request(next(self._ids), prompt, sampler, max_tokens, stop_ids, stops, seed, on_event)
        k = self.depth + 1 if self.mtp else 1
        req.need = len(prompt) + max_tokens + 2 * k + self.depth
        if _capacity(req.need) > self.max_kv_slots:
            raise ValueError(
                f"the request needs {_capacity(req.need)} KV slots, more than max_kv_slots={self.max_kv_slots}"
            )
        self._inbox.put(req)
        return req

    # -- the engine thread -------------------------------------------------------

    def start(self) -> None:
        """Runs the engine on its own thread (every MLX call of the engine happens there)."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mtplx-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stops the engine thread; requests still open end with an error event."""
        if self._thread is None:
            return
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        with self.session():
            while not self._stop.is_set():
                if not self.step():
                    try:
                        item = self._inbox.get(timeout=0.5)
                    except queue.Empty:
                        continue
                    if item is not None:
                        self._admit(item)
            self._fail_all("the engine stopped")
        # MLX keeps per-thread stream state; a thread that ends with it still
        # set up makes the process abort at exit ("terminate called without
        # an active exception", about half the runs here): drain and drop it.
        mx.synchronize()
        mx.clear_streams()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """The context `step` runs in; `start` enters it itself.

        Fused attention, wired memory and, on hybrid trunks, mlx-lm's
        GatedDeltaNet routed through the capture op: all process-wide, and
        all undone when the block ends (`stop` ends the engine thread's).
        """
        from mlx_lm.generate import wired_limit  # noqa: PLC0415

        with wired_limit(self.rt), _fused_attention(self.rt), _route_recurrent(self._route):
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
        return len(self._live)

    @property
    def kv_slots(self) -> int:
        """KV slots the running batch holds (rows times capacity)."""
        return 0 if self._batch is None else self._batch.B * self._batch.cap

    def step(self) -> bool:
        """One engine step (admit, prefill a chunk, recompose, one cycle). False when idle."""
        for item in self._take_inbox():
            self._admit(item)
        self._drop_cancelled()
        self._prefill()
        if self._live or self._ready:
            self._recompose()
        if self._live:
            self._cycle()
        return bool(self._live or self._ready or self._waiting)

    # -- admission ---------------------------------------------------------------

    def _take_inbox(self) -> list[Request]:
        """The requests submitted since the last look (without the stop marker)."""
        items = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)

    def _admit(self, r: Request) -> None:
        self._waiting.append(r)
        self.counters["submitted"] += 1

    def _drop_cancelled(self) -> None:
        for q in (self._waiting,):
            for r in [r for r in q if r.cancelled]:
                q.remove(r)
                self._finish(r, "cancelled")
        for r in [r for r in self._ready if r.cancelled]:
            self._ready.remove(r)
            self._finish(r, "cancelled")
        for r in self._live:
            if r.cancelled and r.finish_reason is None:
                self._finish(r, "cancelled")

    def _fits(self, reqs: Sequence[Request]) -> bool:
        if len(reqs) > self.max_batch:
            return False
        return len(reqs) * _capacity(max(r.need for r in reqs)) <= self.max_kv_slots

    def _prefill(self) -> None:
        """Prefills waiting requests in order: one chunk while streams decode, else all that fit."""
        budget = self.prefill_chunk if self._live else None
        held = [r for r in self._live if r.finish_reason is None] + self._ready
        while self._waiting:
            r = self._waiting[0]
            if r.prefill is None:
                if not self._fits(held + [r]):
                    return  # waits (in order: nothing overtakes it)
                self._start_prefill(r)
            try:
                gen, cyc = r.prefill
                try:
                    next(gen)
                    self.counters["prefill_tokens"] += self.prefill_chunk
                except StopIteration as done:
                    self._waiting.popleft()
                    self._finish_prefill(r, cyc, *done.value)
                    held.append(r)
            except Exception as e:  # noqa: BLE001 - one request fails, the engine goes on
                if self._waiting and self._waiting[0] is r:
                    self._waiting.popleft()
                self._fail(r, e)
            if budget is not None:
                budget -= self.prefill_chunk
                if budget <= 0:
                    return

    def _start_prefill(self, r: Request) -> None:
        rt = self.rt
        cap = _capacity(r.need)
        cache = rt.make_cache([0], ragged=True, capacity=cap)
        head = rt.make_head_cache([0], ragged=True, capacity=cap, depth=self.depth) if self.mtp else None
        s = r.sampler
        policy: Any = GreedyPolicy() if s.greedy and not s.has_penalties else SampledPolicy(s, row_seeds=[r.seed])
        cyc = Cycle(rt, policy, cache, head, self.depth, per_stream=self.mtp)
        r.prefill = (cyc.prefill_steps(mx.array([r.prompt], dtype=mx.int32), self.prefill_chunk), cyc)

    def _finish_prefill(self, r: Request, cyc: Cycle, tokens: mx.array, info: Any) -> None:
        r.prefill = None
        r.row = {**_rows(cyc.caches()), "next": tokens, "info": info, "counts": getattr(cyc.policy, "counts", None)}
        mx.eval(tokens, [a for kv in r.row["kv"] for a in kv], r.row["rec"])
        self.counters["prefill_tokens"] += len(r.prompt) % self.prefill_chunk or self.prefill_chunk
        # The stream's own step count: its first verification (or plain pick) is
        # step 1 (2) of a decode alone.
        r.step_off = self.cycle_count + 1 - (1 if self.mtp else 2)
        # The prefill's token goes out now (time to first token = the prefill),
        # with MTP too: its first cycle's bundle then starts with it again.
        x0 = int(np.array(tokens)[0, 0])
        r.cycles = 0
        self._commit_host(r, [x0], "stop" if x0 in r.stop_ids else ("length" if r.max_tokens <= 1 else None),
                          valid=0 <= x0 < self.vocab)
        if r.finish_reason is not None:
            return
        r.x0_sent = self.mtp
        self._ready.append(r)

    # -- the running batch -------------------------------------------------------

    def _recompose(self) -> None:
        """Drops finished rows and merges prefilled ones into one compact batch."""
        keep = [i for i, r in enumerate(self._live) if r.finish_reason is None]
        new = [r for r in self._ready if r.finish_reason is None]
        if len(keep) == len(self._live) and not new:
            return
        if self._inflight is not None:
            # The cycle launched ahead ran on the old rows: commit it first.
            p, self._inflight = self._inflight, None
            self._read(p)
            keep = [i for i, r in enumerate(self._live) if r.finish_reason is None]
            new = [r for r in self._ready if r.finish_reason is None]
        self._ready = []
        reqs = [self._live[i] for i in keep] + new
        old = self._batch.unload() if self._batch is not None else None
        if old is not None:
            old["next"], old["info"] = self._next, self._info
        self._batch = None
        self._live = reqs
        self.counters["recompositions"] += 1
        if not reqs:
            self._next = self._info = None
            self._streams = None
            return
        B = len(reqs)
        cap = _capacity(max(r.need for r in reqs))
        kind = _kind(reqs)
        parts = []  # (rows dict, index array or None)
        if keep:
            parts.append((old, mx.array(keep, dtype=mx.int32)))
        parts += [(r.row, None) for r in new]
        for r in new:
            r.row = None

        def gather(get: Callable[[dict], mx.array]) -> mx.array:
            return mx.concatenate([get(d) if idx is None else get(d)[idx] for d, idx in parts], axis=0)

        first = parts[0][0]
        rows: dict[str, Any] = {
            "ends": [gather(lambda d, j=j: d["ends"][j]) for j in range(len(first["ends"]))],
            # Capacity is a KV notion: recurrent rows are fixed-size and move as they are.
            "kv": [
                (gather(lambda d, j=j: _fit_cap(d["kv"][j][0], cap)), gather(lambda d, j=j: _fit_cap(d["kv"][j][1], cap)))
                for j in range(len(first["kv"]))
            ],
            "rec": [
                [gather(lambda d, j=j, k=k: d["rec"][j][k]) for k in range(len(leaves))]
                for j, leaves in enumerate(first["rec"])
            ],
            "next": gather(lambda d: d["next"]),
        }
        if self.mtp and kind != "greedy":
            rows["info"] = gather(lambda d: d["info"] if d["info"] is not None else self._one_hot_info(d["next"]))
        else:
            rows["info"] = None
        if kind == "penalties":
            rows["counts"] = gather(
                lambda d: d["counts"] if d["counts"] is not None else mx.zeros((d["next"].shape[0], self.vocab), mx.int32)
            )
        key = (B, cap, kind)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch(self, B, cap, kind)
        batch.load(rows, reqs)
        self._batch = batch
        self._next, self._info = rows["next"], rows["info"]
        st = Streams(B, self.vocab, [r.max_tokens for r in reqs], [r.stop_ids for r in reqs], None,
                     self.depth if self.mtp else 0, self.mtp, 0)
        st.count[:] = [len(r.tokens) - int(r.x0_sent) for r in reqs]
        st.result = self.stats
        self._streams = st

    def _one_hot_info(self, nxt: mx.array) -> mx.array:
        """Draft logits for greedy-drafted rows joining a sampled batch: their argmax is the draft.

        A greedy row's verification only uses where q's mass is, so the draft
        it made by argmax keeps its exact verdict.
        """
        d = nxt[:, 1:]
        hot = mx.arange(self.vocab)[None, None, :] == d[:, :, None]
        return mx.where(hot, 0.0, -30.0).astype(mx.float32)

    #: Launch each cycle before reading the one before it (off: one cycle at a
    #: time, for side-by-side measurements; the tokens are the same).
    launch_ahead = True

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

        The next cycle depends only on device arrays (per-stream commit, plain
        picks), so it runs while the host reads this one's bundle and streams
        the tokens out; a row that finishes meanwhile only wastes its share of
        that cycle, whose tokens for it are ignored.
        """
        try:
            p = self._inflight if self._inflight is not None else self._launch()
            self._inflight = None
            # Unless this cycle may end every stream at its cap.
            if self.launch_ahead and not self._streams.may_all_finish():
                self._inflight = self._launch()
                mx.async_eval(self._inflight.bundle)
        except Exception as e:  # noqa: BLE001 - the batch's state is unknown: fail its rows
            self._fail_batch(e)
            return
        self._read(p)

    def _fail_batch(self, e: BaseException) -> None:
        for r in self._live:
            self._fail(r, e)
        if self._batch is not None:
            self._batch.unload()
        self._batch, self._live, self._next, self._info, self._inflight = None, [], None, None, None

    def _read(self, p: Any) -> None:
        """The cycle's one host read, then each live stream's commit."""
        st, reqs = self._streams, self._live
        try:
            b = np.array(p.bundle)
        except Exception as e:  # noqa: BLE001
            self._fail_batch(e)
            return
        self.stats.cycles += 1
        self.stats.forwards += 1
        # Rows the forward computed, finished ones not yet evicted included.
        self.counters["row_forwards"] += len(reqs)
        for i, r in enumerate(reqs):
            if r.finish_reason is not None or st.done[i]:
                continue
            try:
                if self.mtp:
                    _, new, reason = st.decide_stream(b, i)
                else:
                    _, new, reason = st.decide_plain_stream(b, i)
            except Exception as e:  # noqa: BLE001
                st.done[i] = True
                self._fail(r, e)
                continue
            if self.mtp:
                n = int(b[i, chain.COL_N])
                r.cycles += 1
                acc = len(new) - 1
                r.accepted += acc
                r.drafted += acc + (1 if acc < self.depth and reason is None else 0) if n >= 0 else 0
                if r.x0_sent:
                    new, r.x0_sent = new[1:], False
            self._commit_host(r, new, reason)

    # -- host side of a request ---------------------------------------------------

    def _commit_host(self, r: Request, new: list[int], reason: str | None, valid: bool = True) -> None:
        if not valid:
            self._fail(r, RuntimeError(f"request {r.id}: invalid first token (non-finite logits)"))
            return
        if r.first_token_s is None and new:
            r.first_token_s = time.perf_counter()
        r.tokens.extend(new)
        self.counters["generated_tokens"] += len(new)
        text = ""
        if self.tokenizer is not None:
            text, cut = self._text(r, final=reason is not None)
            if cut:
                reason = "stop"
        try:
            r._emit(Event("tokens", tokens=list(new), text=text))
        except Exception as e:  # noqa: BLE001 - a failing callback fails its request only
            self._fail(r, e)
            return
        if reason is not None:
            self._finish(r, reason)

    def _text(self, r: Request, final: bool) -> tuple[str, bool]:
        """(newly final text, whether a stop string ended it).

        Decodes only the tokens after the newest mark whose text is already
        out (and, for stop strings, more than a stop string's length back),
        with a few tokens before it as context: decoding the whole request on
        every commit costs quadratic time in its length.
        """
        longest = max((len(x) for x in r.stop), default=0)
        need = max(0, r._sent - max(longest - 1, 0))  # the first character the stop search reads
        while len(r._marks) > 1 and r._marks[1][1] <= need:
            r._marks.pop(0)
        base_tok, base = r._marks[0]
        ctx = max(0, base_tok - _DETOK_CONTEXT)
        head = self.tokenizer.decode(r.tokens[ctx:base_tok]) if base_tok else ""
        tail = self.tokenizer.decode(r.tokens[ctx:])
        if not tail.startswith(head):  # context-dependent decoding: the whole text
            base_tok, base, tail, head = 0, 0, self.tokenizer.decode(r.tokens), ""
            r._marks = [(0, 0)]
        window = tail[len(head):]  # the text from character `base` on
        if not window.endswith("\ufffd"):
            r._marks.append((len(r.tokens), base + len(window)))
        if not final:
            window = window.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its bytes
        cut = False
        end_all = base + len(window)
        if r.stop:
            hits = [i for i in (window.find(x, need - base) for x in r.stop) if i >= 0]
            if hits:
                end_all, cut, final = base + min(hits), True, True
        # Hold back what could still become a stop string.
        hold = 0 if final or not r.stop else longest - 1
        end = max(r._sent, end_all - hold)
        out = window[r._sent - base : end - base]
        r._sent = end
        r.text += out
        return out, cut

    def _finish(self, r: Request, reason: str) -> None:
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        self.counters["cancelled" if reason == "cancelled" else "finished"] += 1
        r._emit(Event("done", finish_reason=reason))

    def _fail(self, r: Request, e: BaseException) -> None:
        if r.done:
            return
        r.finish_reason = "error"
        r.error = str(e) or type(e).__name__
        r.prefill = r.row = None
        self.counters["failed"] += 1
        r._emit(Event("error", error=r.error))

    def _fail_all(self, why: str) -> None:
        for r in list(self._waiting) + self._ready + self._live:
            if not r.done:
                self._fail(r, RuntimeError(why))
        for item in self._take_inbox():
            self._fail(item, RuntimeError(why))

    # -- statistics ---------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Counters and MTP statistics (thread-safe enough to read from handlers)."""
        s = self.stats
        return {
            **self.counters,
            "live_streams": len(self._live),
            "waiting": len(self._waiting),
            "kv_slots": self.kv_slots,
            "max_batch": self.max_batch,
            "max_kv_slots": self.max_kv_slots,
            "depth": self.depth if self.mtp else 0,
            "cycles": s.cycles,
            "acceptance": s.acceptance_rate,
            "acceptance_per_depth": s.acceptance_per_depth,
            "mean_accepted_length": s.mean_accepted_length,
        }


__all__ = ["Engine", "Event", "Request"]
