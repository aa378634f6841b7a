"""What a client hands the engine and what it gets back: `Request` and its `Event`s.

A `Request` is created by `Engine.submit` on any thread and read there: its
events arrive on a queue (`events()`, `wait()`) or through a callback that
runs on the engine's thread. The engine thread alone writes the fields under
"engine-thread state".
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtplx_ext.batching.detok import Detokenizer
from mtplx_ext.batching.scheduler import RowInfo
from mtplx_ext.decode.stats import DraftStats
from mtplx_ext.sampling import SamplerConfig


@dataclass
class Event:
    """What a request emits: new tokens, its end, or its failure.

    Attributes:
        kind: "tokens", "done" or "error".
        tokens: newly committed token ids ("tokens").
        text: newly final text (with a tokenizer; stop strings cut it).
        finish_reason: "stop", "length" or "cancelled" ("done").
        error: the message ("error").
        logprobs: per token, (logprob, [(id, logprob)] alternatives), when
            the request asked (`token_logprobs`); else None.
    """

    kind: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class Request:
    """One submitted request; read its tokens as they are committed.

    Attributes:
        id: the engine's request number.
        prompt: prompt token ids.
        tokens: committed token ids so far.
        text: final text so far (with a tokenizer).
        finish_reason: None while running, else "stop", "length", "cancelled" or "error".
        error: the failure message, if any.
        depth: the most drafts one cycle may commit for it (0: one token per cycle).
        stats: the request's own MTP statistics (`DraftStats`).
        cycles: decode cycles its row ran in.
        submitted_s, first_token_s, finished_s: `time.perf_counter()` stamps.
        logprobs: None, or the alternatives per token it asked for (0..20).
        token_logprobs: per committed token, (logprob, alternatives): the
            raw log-softmax of the target's logits (`engine.logprobs`).
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
        depth: int = 0,
        tokenizer: Any = None,
        logprobs: int | None = None,
    ):
        self.id = rid
        self.logprobs = logprobs
        self.token_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.lp_next: Any = None  # the entry of the next x0 (engine thread)
        self.prompt = prompt
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.stop = stop
        self.seed = seed
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.depth = depth  # most drafts a cycle may commit for it
        self.stats = DraftStats(depth=depth)
        self.cycles = 0  # decode cycles its row ran in
        self.submitted_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self._on_event = on_event
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        # Engine-thread state.
        self.detok = Detokenizer(tokenizer, stop) if tokenizer is not None else None
        self.need = 0  # KV slots this request may use
        self.prefill: Any = None  # (generator, Cycle) while prefilling
        self.prefill_from = 0  # prompt positions loaded from the prefix cache
        self.prefill_pos = 0  # prompt positions in its caches while prefilling
        self.row: Any = None  # its device rows once prefilled, until merged
        self.row_index: int | None = None  # its row in `row` when prefilled in a group (None: all of it)
        self.step_off = 0  # cycle the stream's own step count starts from
        # MTP: x0 was committed at the prefill; the first bundle repeats it.
        self.x0_committed = False
        self.constraint: Any = None  # a `Constraint` (a grammar) of this request only

    def info(self) -> RowInfo:
        """What the scheduler reads of this request (`scheduler.RowInfo`)."""
        s = self.sampler
        kind = "penalties" if s.has_penalties else "greedy" if s.greedy else "sampled"
        return RowInfo(self.id, self.need, kind, s.has_bias, self.logprobs is not None, self.constraint is not None,
                       self.depth, self.finish_reason is not None)

    @property
    def text(self) -> str:
        """The final text so far ("" without a tokenizer)."""
        return self.detok.text if self.detok is not None else ""

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
    def drafted(self) -> int:
        return self.stats.drafted

    @property
    def accepted(self) -> int:
        return self.stats.accepted

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per cycle of this request."""
        return self.stats.mean_accepted_length

    @property
    def acceptance(self) -> float:
        return self.stats.acceptance_rate

    def finish(self, reason: str) -> bool:
        """Ends the request with a "done" event (engine thread); False if it had already ended."""
        if self.finish_reason is not None:
            return False
        self.finish_reason = reason
        self.emit(Event("done", finish_reason=reason))
        return True

    def fail(self, message: str) -> bool:
        """Ends the request with an "error" event and drops its device state; False if it had ended."""
        if self.done:
            return False
        self.finish_reason, self.error = "error", message
        self.prefill = self.row = None
        self.emit(Event("error", error=message))
        return True

    def emit(self, ev: Event) -> None:
        """Delivers an event (engine thread): queue, callback, and the end stamp."""
        self._events.put(ev)
        if self._on_event is not None:
            self._on_event(ev)
        if ev.kind in ("done", "error"):
            self.finished_s = time.perf_counter()
            self._done.set()


__all__ = ["Event", "Request"]
