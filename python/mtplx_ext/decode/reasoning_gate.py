"""A reasoning phase in front of a token constraint: free text, an optional budget, then the inner constraint.

Reasoning models write `<think> ... </think>` (or their family's markers)
before the answer. A grammar (a JSON schema, a forced tool call) must apply
to the answer only, and a reasoning budget must end the reasoning after a
number of tokens. `ReasoningGate` does both as one `Constraint`
(`decode.constraint`), so the engine runs it like any grammar, MTP on in
both phases:

* before the reasoning (`phase="before"`: the prompt did not open it), the
  first tokens may open it with the start marker; with an inner constraint
  only a start marker that is one token can (anything else is the answer's
  first token, checked by the inner constraint);
* in the reasoning every token is allowed (the stop tokens too, unless an
  inner constraint waits for the answer: then the answer must come), until
  the end marker is seen in the tokens' text (or its one token id);
* once `budget` reasoning tokens are consumed, the end marker's tokens are
  forced one by one (`forced_tokens` lets the engine draft them);
* after the end marker every token goes to the inner constraint (or is
  allowed, without one).

The state is the consumed tokens; a history of per-token states makes
`rollback` exact. The end marker is matched on each token's decoded text, so
a marker the model spells in several tokens is found too; the answer starts
with the token after the one that completes the marker.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: The phases, in order.
PHASES = ("before", "reasoning", "closing", "answer")


def _set_bit(out: np.ndarray, t: int, on: bool) -> None:
    words = out.view(np.uint32)
    if 0 <= t < words.size * 32:
        bit = np.uint32(1 << (t % 32))
        words[t // 32] = (words[t // 32] | bit) if on else (words[t // 32] & ~bit)


class ReasoningGate:
    """A `Constraint` that lets reasoning through, bounds it, then hands over to `inner`.

    Args:
        inner: the answer's constraint (a grammar), or None (the answer is free).
        decode: token id -> its text (the tokenizer's, as the detokenizer decodes it).
        start: the start marker's text; `start_ids` its token ids.
        end: the end marker's text; `end_ids` its token ids (what a budget forces).
        phase: "before" (the prompt did not open the reasoning) or "reasoning" (it did).
        budget: most reasoning tokens before the end marker is forced (None: no bound).
        stop_ids: tokens refused during the reasoning when there is an inner constraint.
    """

    def __init__(self, inner: Any, decode: Callable[[int], str], start: str, start_ids: Sequence[int], end: str,
                 end_ids: Sequence[int], *, phase: str = "reasoning", budget: int | None = None,
                 stop_ids: Sequence[int] = ()):
        if phase not in ("before", "reasoning"):
            raise ValueError(f"phase must be 'before' or 'reasoning', got {phase!r}")
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be >= 0 or None, got {budget!r}")
        if not end or not end_ids:
            raise ValueError("end (the end marker) and end_ids must be non-empty")
        self.inner = inner
        self.decode = decode
        self.start, self.start_ids = start, tuple(int(t) for t in start_ids)
        self.end, self.end_ids = end, tuple(int(t) for t in end_ids)
        self.budget = budget
        self.stop_ids = tuple(int(t) for t in stop_ids) if inner is not None else ()
        self.pieces: dict[int, str] = {}
        # The state: phase, reasoning tokens, text tail (marker matching), forced position.
        self.phase, self.count, self.tail, self.forced = phase, 0, "", 0
        self.history: list[tuple[tuple[str, int, str, int], bool]] = []
        if phase == "before" and inner is not None and len(self.start_ids) != 1:
            self.phase = "answer"  # a grammar cannot wait on a start marker of several tokens
        self._maybe_close()

    # -- the Constraint protocol ----------------------------------------------------

    def fork(self) -> "ReasoningGate":
        g = copy.copy(self)
        g.inner = self.inner.fork() if self.inner is not None else None
        g.history = list(self.history)
        return g

    def advance(self, tokens: Sequence[int]) -> int:
        n = 0
        for t in tokens:
            if not self._step(int(t)):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        inner_n = 0
        state = None
        for _ in range(min(int(n), len(self.history))):
            state, consumed = self.history.pop()
            inner_n += consumed
        if state is not None:
            self.phase, self.count, self.tail, self.forced = state
        if inner_n and self.inner is not None:
            self.inner.rollback(inner_n)

    def fill_mask(self, out: np.ndarray) -> None:
        if self.phase == "closing":
            out[:] = 0
            _set_bit(out, self.end_ids[self.forced], True)
        elif self.phase == "answer" or (self.phase == "before" and self.inner is not None):
            if self.inner is None:
                out[:] = -1
            else:
                self.inner.fill_mask(out)
                if self.phase == "before":
                    _set_bit(out, self.start_ids[0], True)
        else:
            out[:] = -1
            for t in self.stop_ids if self.phase == "reasoning" else ():
                _set_bit(out, t, False)

    def is_terminated(self) -> bool:
        return self.phase == "answer" and self.inner is not None and bool(self.inner.is_terminated())

    def forced_tokens(self) -> list[int]:
        """The end marker's remaining tokens while a budget closes the reasoning; the inner's afterwards."""
        if self.phase == "closing":
            return list(self.end_ids[self.forced:])
        if self.phase == "answer" and self.inner is not None and hasattr(self.inner, "forced_tokens"):
            return list(self.inner.forced_tokens())
        return []

    # -- one token --------------------------------------------------------------------

    def _piece(self, t: int) -> str:
        p = self.pieces.get(t)
        if p is None:
            p = self.pieces[t] = self.decode(t)
        return p

    def _maybe_close(self) -> None:
        if self.phase == "reasoning" and self.budget is not None and self.count >= self.budget:
            self.phase, self.forced = "closing", 0

    def _step(self, t: int) -> bool:
        state = (self.phase, self.count, self.tail, self.forced)
        consumed = False
        if self.phase == "before":
            if self.inner is not None:
                if t == self.start_ids[0]:
                    self.phase, self.tail = "reasoning", ""
                elif self.inner.advance([t]) == 1:
                    self.phase, consumed = "answer", True
                else:
                    return False
            else:
                self.tail += self._piece(t)
                lead = self.tail.lstrip()
                if lead.startswith(self.start):
                    self.phase, self.tail = "reasoning", ""
                elif not self.start.startswith(lead):
                    self.phase, self.tail = "answer", ""
        elif self.phase == "reasoning":
            if t in self.stop_ids:
                return False
            self.count += 1
            text = self.tail + self._piece(t)
            if (len(self.end_ids) == 1 and t == self.end_ids[0]) or self.end in text:
                self.phase, self.tail = "answer", ""
            else:
                self.tail = text[-(len(self.end) - 1):] if len(self.end) > 1 else ""
        elif self.phase == "closing":
            if t != self.end_ids[self.forced]:
                return False
            self.forced += 1
            if self.forced == len(self.end_ids):
                self.phase, self.tail = "answer", ""
        elif self.inner is not None:
            if self.inner.advance([t]) != 1:
                return False
            consumed = True
        self._maybe_close()
        self.history.append((state, consumed))
        return True


__all__ = ["PHASES", "ReasoningGate"]
