"""What one engine step did: `StepResult` (returned by `Engine.step`) and the log it is built from.

The engine notes each fact where it already knows it (an admission, a prefill chunk, a recomposition's plan,
a cycle's read, a commit, an end): appending to small lists, no device sync and no extra host work. A step's
result covers what happened since the previous step returned (an admission made by the idle engine thread
between two steps is reported by the next one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recomposition:
    """The running batch rebuilt (`scheduler.BatchPlan` as run), by request ids.

    Attributes:
        kept: rows of the old batch that go on, in their new order.
        joined: prefilled requests that joined after them.
        left: rows of the old batch dropped (finished, cancelled or failed).
        depth: the new batch's K (0: one token per cycle); None when no row remains.
        drained: a cycle launched ahead on the old rows was read first (what it committed is in the step's
            `committed`; it is not the step's `cycle`).
    """

    kept: tuple[int, ...]
    joined: tuple[int, ...]
    left: tuple[int, ...]
    depth: int | None
    drained: bool = False

    @property
    def rows(self) -> int:
        """Rows of the new batch."""
        return len(self.kept) + len(self.joined)


@dataclass(frozen=True)
class CycleRun:
    """A decode cycle whose bundle the step read: its K (0 for plain decoding) and its rows (finished rows not
    evicted yet included)."""

    depth: int
    rows: int


@dataclass(frozen=True)
class StepResult:
    """What one `Engine.step` did.

    Attributes:
        admitted: ids of the requests queued for prefill.
        prefill_tokens: prompt tokens forwarded, per request id (a prefix-cache hit's are not forwarded).
        prefilled: ids of the requests whose prefill completed (their first token went out).
        recomposed: the batch rebuild, or None when the running batch stayed as it was.
        cycle: the decode cycle of the step's last phase, run on the (recomposed) running batch and read, or None
            (no running batch; it failed; a cycle launched ahead after every row had finished is not one).
        committed: tokens committed per request id (a prefill's first token included).
        finished: ids of the requests that ended ("done" or "error" event), in the order they ended.
        idle: no request is left waiting, prefilling or decoding: the loop may wait for a submission.

    `bool(result)` is `not result.idle`, the value `step` returned before it returned this record, so
    `while engine.step(): ...` steps until the engine is idle.
    """

    admitted: tuple[int, ...] = ()
    prefill_tokens: Mapping[int, int] = field(default_factory=dict)
    prefilled: tuple[int, ...] = ()
    recomposed: Recomposition | None = None
    cycle: CycleRun | None = None
    committed: Mapping[int, int] = field(default_factory=dict)
    finished: tuple[int, ...] = ()
    idle: bool = True

    def __bool__(self) -> bool:
        return not self.idle

    @property
    def tokens(self) -> int:
        """Tokens committed in all."""
        return sum(self.committed.values())


class StepLog:
    """The facts of the step under way (engine thread): the engine appends, `result` freezes and restarts."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.admitted: list[int] = []
        self.prefill_tokens: dict[int, int] = {}
        self.prefilled: list[int] = []
        self.recomposed: Recomposition | None = None
        self.cycle: CycleRun | None = None
        self.committed: dict[int, int] = {}
        self.finished: list[int] = []

    def prefill(self, rid: int, tokens: int) -> None:
        self.prefill_tokens[rid] = self.prefill_tokens.get(rid, 0) + tokens

    def commit(self, rid: int, tokens: int) -> None:
        self.committed[rid] = self.committed.get(rid, 0) + tokens

    def result(self, idle: bool) -> StepResult:
        """The step's record; the log starts the next step empty."""
        out = StepResult(tuple(self.admitted), self.prefill_tokens, tuple(self.prefilled), self.recomposed,
                         self.cycle, self.committed, tuple(self.finished), idle)
        self.clear()
        return out


__all__ = ["CycleRun", "Recomposition", "StepLog", "StepResult"]
