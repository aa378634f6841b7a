"""`RowRecord`: the engine's own record of a request, from its admission to its end (engine thread only).

The client holds the `Request` handle; the engine works on this record: the
request's frozen `RowSettings` (what the runner reads: sampler, seed,
constraint, logprobs, depth, stops, max_tokens), the KV slots it may use,
and the scratch of its prefill and of its row in the running batch. The
record reaches the handle only to deliver commits and the request's end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mtplx_ext.batching.detok import Detokenizer
from mtplx_ext.batching.requests import Event, Request, RowSettings, SettingsView
from mtplx_ext.batching.scheduler import RowInfo
from mtplx_ext.decode.stats import DraftStats


@dataclass(eq=False)
class RowRecord(SettingsView):
    """One request as the engine sees it (compared by identity).

    Attributes:
        req: the client's handle.
        settings: what it asked for (frozen; the handle's `settings` too), read by name as on the handle
            (`sampler`, `seed`, `max_tokens`, `stop_ids`, `stop`, `depth`, `logprobs`, `constraint`).
        need: KV slots it may use (`admission.request_need`).
        detok: its text and stop strings (with a tokenizer), or None.
        prefill: (generator, Cycle) while it prefills alone.
        prefill_from: prompt positions loaded from the prefix cache.
        prefill_pos: prompt positions in its caches while it prefills.
        row: its device rows (`batch.Rows`) once prefilled, until merged into the running batch.
        row_index: its row in `row` when prefilled in a group (None: all of it).
        step_off: the cycle its stream's own step count starts from (`SampledPolicy.step_base`).
        x0_committed: with MTP, its x0 went out at the prefill; its first bundle repeats it.
        lp_next: the logprob entry of its next x0 (`token_logprobs`).
        first: its prefill's first token not read yet: (tokens, row, logprobs), read once its batch's first
            cycle is launched (`PrefillPhase._deliver_firsts`); None otherwise.
    """

    req: Request
    settings: RowSettings
    need: int
    detok: Detokenizer | None = None
    prefill: Any = None
    prefill_from: int = 0
    prefill_pos: int = 0
    row: Any = None
    row_index: int | None = None
    step_off: int = 0
    x0_committed: bool = False
    lp_next: Any = None
    first: Any = None
    # `info()`, built once: its fields never change while the request runs.
    _info: RowInfo | None = field(default=None, init=False, repr=False)

    @classmethod
    def new(cls, rid: int, prompt: list[int], settings: RowSettings, need: int,
            on_event: Callable[[Event], None] | None = None, tokenizer: Any = None) -> RowRecord:
        """The record of a new request, with its client handle (`req`)."""
        detok = Detokenizer(tokenizer, settings.stop) if tokenizer is not None else None
        return cls(Request(rid, prompt, settings, on_event), settings, need, detok)

    # -- read-only views ---------------------------------------------------------

    @property
    def id(self) -> int:
        return self.req.id

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt

    @property
    def tokens(self) -> list[int]:
        """What it committed so far (the handle's list: read, never written here)."""
        return self.req.tokens

    @property
    def stats(self) -> DraftStats:
        """Its own MTP statistics (recorded into by the batch's `Streams`)."""
        return self.req.stats

    @property
    def finish_reason(self) -> str | None:
        return self.req.finish_reason

    @property
    def cancelled(self) -> bool:
        return self.req.cancelled

    @property
    def done(self) -> bool:
        return self.req.done

    def info(self) -> RowInfo:
        """What the scheduler reads of this request (`scheduler.RowInfo`; built once, read every step)."""
        if self._info is None:
            s = self.sampler
            kind = "penalties" if s.has_penalties else "greedy" if s.greedy else "sampled"
            self._info = RowInfo(self.id, self.need, kind, s.has_bias, self.logprobs is not None,
                                 self.constraint is not None, self.depth)
        return self._info if self.finish_reason is None else replace(self._info, finished=True)

    # -- the request's end -------------------------------------------------------

    def finish(self, reason: str) -> bool:
        """Ends the request with a "done" event; False if it had already ended."""
        return self.req.finish(reason)

    def fail(self, message: str) -> bool:
        """Ends the request with an "error" event and drops its device state; False if it had ended."""
        if self.done:
            return False
        self.prefill = self.row = None
        return self.req.fail(message)


__all__ = ["RowRecord"]
