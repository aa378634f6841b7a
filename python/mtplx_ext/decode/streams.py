"""Host-side bookkeeping of a batched decode: commits, finish reasons, statistics."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mtplx_ext.decode.bundle import COL_N, COL_TOKENS, COL_X0
from mtplx_ext.decode.results import BatchedDecodeResult, StreamResult
from mtplx_ext.decode.stats import DraftStats

OnCommit = Callable[[int, list[int]], None]

#: A host decision: per stream (index, new tokens, finish reason or None).
Commits = list[tuple[int, list[int], str | None]]


class InvalidRow(RuntimeError):
    """A stream's row became invalid (non-finite logits, a token outside the vocabulary): the message names the
    stream's row; `detail` says what happened without it (an engine reports it for its request)."""

    def __init__(self, row: int, detail: str):
        super().__init__(f"stream {row}: {detail}")
        self.detail = detail


class Streams:
    """What each stream has committed, and what a cycle's bundle means for it.

    Args:
        n: streams.
        vocab_size: the model's vocabulary.
        max_new_tokens: cap on each stream's generated tokens (one for all,
            or one per stream).
        stop_ids: tokens that end a stream (kept); one set for all, or one
            per stream.
        on_commit: callback(stream, new tokens) or None.
        depth: drafts per cycle (0 for plain decoding).
        per_stream: per-stream commit (a stream commits x0, d_1..d_n and its
            c_{n+1} is the next cycle's x0) instead of uniform repair.
        width: prompt slots of the caches.
    """

    def __init__(
        self,
        n: int,
        vocab_size: int,
        max_new_tokens: int | Sequence[int],
        stop_ids: frozenset[int] | Sequence[frozenset[int]],
        on_commit: OnCommit | None,
        depth: int = 0,
        per_stream: bool = False,
        width: int = 0,
    ):
        self.vocab_size = vocab_size
        self.depth = depth
        self.per_stream = per_stream
        self.result = BatchedDecodeResult(streams=[StreamResult() for _ in range(n)], depth=depth)
        #: Per-stream statistics to record into as well (one `DraftStats` per stream), or None.
        self.row_stats: list[DraftStats] | None = None
        per_cap = not isinstance(max_new_tokens, int)
        self.caps = np.array(max_new_tokens if per_cap else [max_new_tokens] * n, dtype=np.int64)
        self.max_new = int(self.caps.max()) if n else 0
        self.stops = list(stop_ids) if not isinstance(stop_ids, frozenset) else [stop_ids] * n
        self.on_commit = on_commit
        self.done = np.zeros(n, dtype=bool)
        self.count = np.zeros(n, dtype=np.int64)
        self.width = width
        #: Streams whose next bundle starts with an x0 they already committed
        #: (see `resume`): their next decide leaves it out, once.
        self.x0_committed = np.zeros(n, dtype=bool)
        #: Most drafts each stream may accept (its bundle's n is cut to it on the device).
        self.row_depth = np.full(n, depth, dtype=np.int64)

    def resume(self, committed: Sequence[int], x0_committed: Sequence[bool]) -> None:
        """Streams that already committed tokens before this batch (continuous batching).

        Args:
            committed: tokens each stream committed so far.
            x0_committed: whether that includes the x0 its next bundle
                starts with: a prefill commits its token at once (time to
                first token is the prefill), and with MTP the stream's first
                verification bundle repeats it as x0.
        """
        self.x0_committed[:] = np.asarray(x0_committed, dtype=bool)
        self.count[:] = np.asarray(committed, dtype=np.int64) - self.x0_committed

    def _fail(self, i: int, why: str) -> None:
        raise InvalidRow(i, f"invalid decode row ({why}) after {self.count[i]} committed tokens")

    def _walk(self, i: int, toks: list[int], n: int | None) -> tuple[list[int], str | None]:
        """The prefix of `toks` stream i commits, stopping at a stop token or its cap.

        Also records the drafts whose verdict was used (n: accepted drafts)
        in the decode's statistics and, when given, the stream's own.
        """
        new: list[int] = []
        checked = accepted = 0
        reason = None
        for j, t in enumerate(toks):
            if j > 0 and n is not None and n < 0:
                self._fail(i, "non-finite verification logits")
            if not 0 <= t < self.vocab_size:
                self._fail(i, f"token {t} outside the vocabulary (non-finite logits)")
            new.append(t)
            if t in self.stops[i]:
                reason = "stop"
                break
            if self.count[i] + len(new) >= self.caps[i]:
                reason = "length"
                break
            if n is not None and j < self.row_depth[i] and j <= n:
                # The stream goes on after token j: draft j + 1 was checked.
                checked += 1
                accepted += j < n
        proposed = int(self.row_depth[i]) if n is not None else 0
        self.result.record(checked, accepted, proposed)
        if self.row_stats is not None:
            self.row_stats[i].record(checked, accepted, proposed)
        return new, reason

    def decide_plain(self, b: np.ndarray) -> Commits:
        """[B, 1] next tokens of a plain step."""
        return [self.decide_plain_stream(b, int(i)) for i in np.flatnonzero(~self.done)]

    def decide_plain_stream(self, b: np.ndarray, i: int) -> tuple[int, list[int], str | None]:
        """What stream i commits from a plain step's [B, 1] tokens."""
        return self._take(i, *self._walk(i, [int(b[i, 0])], None))

    def decide(self, b: np.ndarray) -> tuple[Commits, int | None]:
        """What each live stream commits from a [B, K + 3] chain bundle.

        Returns:
            (commits, r): r is None when no repair forward is needed, else
            (uniform repair) the tokens after x0 that the batch re-forwards.

        Raises:
            RuntimeError: naming the first stream that needs a token from an
                invalid row (n = -1 or a token outside the vocabulary).
        """
        K = self.depth
        live = np.flatnonzero(~self.done)
        if self.per_stream:
            return [self.decide_stream(b, int(i)) for i in live], None
        # Uniform repair: a stream that goes on may commit c_1..c_{min(n+1, K)};
        # the batch commits as many as the one that may commit fewest.
        walked, r = [], K
        for i in live:
            n = int(b[i, COL_N])
            m = min(n + 1, K) if n >= 0 else 1
            toks = [int(b[i, COL_X0])] + [int(t) for t in b[i, COL_TOKENS : COL_TOKENS + m]]
            new, reason = self._walk(int(i), toks, n)
            walked.append((int(i), new, reason))
            if reason is None and n < K:
                r = min(r, n + 1)
        repair = any(reason is None and int(b[i, COL_N]) < K for i, _, reason in walked)
        out = [self._take(i, new if reason else new[: r + 1], reason) for i, new, reason in walked]
        return out, (r if repair else None)

    def decide_stream(self, b: np.ndarray, i: int) -> tuple[int, list[int], str | None]:
        """Per-stream commit: what stream i commits from a chain bundle (RuntimeError if invalid)."""
        n = int(b[i, COL_N])
        toks = [int(b[i, COL_X0])] + [int(t) for t in b[i, COL_TOKENS : COL_TOKENS + max(n, 0)]]
        i, new, reason = self._take(i, *self._walk(i, toks if n >= 0 else toks + [-1], n))
        if self.x0_committed[i]:
            self.x0_committed[i] = False
            new = new[1:]
        return i, new, reason

    def _take(self, i: int, new: list[int], reason: str | None) -> tuple[int, list[int], str | None]:
        self.count[i] += len(new)
        if reason:
            self.done[i] = True
        return i, new, reason

    def apply(self, commits: Commits) -> None:
        """Appends committed tokens and calls the on_commit callback."""
        for i, new, reason in commits:
            s = self.result.streams[i]
            s.tokens.extend(new)
            if reason:
                s.finish_reason = reason
            if self.on_commit is not None:
                self.on_commit(i, new)

    def may_all_finish(self) -> bool:
        """Whether the in-flight cycle may bring every live stream to its cap."""
        live = ~self.done
        return bool(np.all(self.count[live] + self.depth + 1 >= self.caps[live]))

    def any_live(self) -> bool:
        return not bool(self.done.all())

    def slots_needed(self) -> int:
        """Cache slots (prompt included) the next launched step may write for live streams.

        A step writes at most K + 1 slots after a stream's committed tokens
        (its head K - 1 more for chained drafts, dropped again), and the step
        before it (launched, not read yet) commits at most K + 1 more. A
        stream whose count would pass max_new_tokens is finished: its writes
        are clamped and ignored.
        """
        live = self.count[~self.done]
        most = int(live.max()) if live.size else 0
        k = self.depth + 1
        return self.width + min(most + 2 * k, self.max_new + k) + max(self.depth - 1, 0)
