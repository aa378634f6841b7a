"""What a client hands the engine and what it gets back: its `RowSettings`, the `Request` handle and its `Event`s.

A `Request` is created by `Engine.submit` on any thread and read there: its
events arrive on a queue (`events()`, `wait()`) or through a callback that
runs on the engine's thread. It holds what the client sees only; the
engine's working state of the request is its own record (`rows.RowRecord`),
and the engine thread alone writes the handle's fields (through `commit`,
`finish` and `fail`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class RowSettings:
    """What a request asked for, checked (`rules.RequestRules`) and fixed at `submit`: what the engine's runner
    reads of its row. A new per-request feature adds its field here (and its check to `rules`).

    Attributes:
        sampler: its `SamplerConfig` (greedy, sampled, penalties, logit bias).
        seed: the sampled path's seed (drawn when the client gave none).
        max_tokens: cap on generated tokens.
        stop_ids: tokens that end it (kept).
        stop: strings that end it (cut from its text).
        depth: the most drafts one cycle may commit for it (0: one token per cycle).
        logprobs: None, or the alternatives per token it asked for (0..20).
        constraint: a `Constraint` (a grammar) of this request only, or None.
    """

    sampler: SamplerConfig
    seed: int
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    depth: int = 0
    logprobs: int | None = None
    constraint: Any = None


class SettingsView:
    """Read-only views of a request's `settings` (a `RowSettings`), by name (`req.sampler`, `req.depth`, ...)."""

    settings: RowSettings

    @property
    def sampler(self) -> SamplerConfig:
        return self.settings.sampler

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def max_tokens(self) -> int:
        return self.settings.max_tokens

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.settings.stop_ids

    @property
    def stop(self) -> tuple[str, ...]:
        return self.settings.stop

    @property
    def depth(self) -> int:
        """The most drafts one cycle may commit for it (0: one token per cycle)."""
        return self.settings.depth

    @property
    def logprobs(self) -> int | None:
        return self.settings.logprobs

    @property
    def constraint(self) -> Any:
        return self.settings.constraint


class Request(SettingsView):
    """One submitted request, the client's handle: read its tokens as they are committed.

    The engine keeps its own record of the request (`rows.RowRecord`); it reaches this handle only to
    deliver what it committed (`commit`) and its end (`finish`, `fail`), on its own thread.

    Attributes:
        id: the engine's request number.
        prompt: prompt token ids.
        settings: what it asked for (`RowSettings`); `sampler`, `seed`, `max_tokens`, `stop_ids`, `stop`,
            `depth`, `logprobs` and `constraint` read them.
        tokens: committed token ids so far.
        text: final text so far (with a tokenizer; stop strings cut it).
        finish_reason: None while running, else "stop", "length", "cancelled" or "error".
        error: the failure message, if any.
        stats: the request's own MTP statistics (`DraftStats`).
        cycles: decode cycles its row ran in.
        cached_tokens: prompt tokens its prefill loaded from the prefix cache instead of forwarding them.
        submitted_s, first_token_s, finished_s: `time.perf_counter()` stamps.
        token_logprobs: per committed token, (logprob, alternatives): the
            raw log-softmax of the target's logits (`engine.logprobs`).
    """

    def __init__(self, rid: int, prompt: list[int], settings: RowSettings,
                 on_event: Callable[[Event], None] | None = None):
        self.id = rid
        self.prompt = prompt
        self.settings = settings
        self.tokens: list[int] = []
        self.text = ""
        self.token_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stats = DraftStats(depth=settings.depth)
        self.cycles = 0  # decode cycles its row ran in
        self.cached_tokens = 0
        self.submitted_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self._on_event = on_event
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._done = threading.Event()
        self._cancel = threading.Event()

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
        """Ends the request with an "error" event (engine thread); False if it had ended."""
        if self.done:
            return False
        self.finish_reason, self.error = "error", message
        self.emit(Event("error", error=message))
        return True

    def commit(self, new: list[int], text: str = "", logprobs: list | None = None) -> None:
        """Delivers committed tokens (engine thread): appended with their text and logprobs, then a "tokens"
        event (which raises what its callback raised)."""
        if self.first_token_s is None and new:
            self.first_token_s = time.perf_counter()
        self.tokens.extend(new)
        self.token_logprobs.extend(logprobs or ())
        self.text += text
        self.emit(Event("tokens", tokens=list(new), text=text, logprobs=logprobs))

    def emit(self, ev: Event) -> None:
        """Delivers an event (engine thread): queue, callback, and the end stamp."""
        self._events.put(ev)
        if self._on_event is not None:
            self._on_event(ev)
        if ev.kind in ("done", "error"):
            self.finished_s = time.perf_counter()
            self._done.set()


__all__ = ["Event", "Request", "RowSettings", "SettingsView"]
