"""Acceptance statistics, counted once: per cycle, how far each stream's drafts were checked.

`DraftStats.record(checked, accepted)` is the one place a stream's cycle is
counted: `checked` drafts had their verdict used (every earlier draft of the
cycle accepted and the stream still going on), the first `accepted` of them
were accepted. Fixed-batch decoding (`BatchedDecodeResult`), the engine's
totals and each request's own statistics are all `DraftStats` fed by
`Streams` from the same walk over the bundle.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class DraftStats:
    """Draft verdicts of a decode (or of one stream of it).

    Attributes:
        depth: drafts per cycle (K; 0 for plain decoding).
        stream_cycles: (stream, cycle) pairs that verified drafts.
        drafted: drafts whose verdict mattered (reached[i] summed).
        accepted: those drafts that were accepted (committed).
        reached: per draft position i = 1..K, how often draft i was checked.
        accepted_at: per draft position, how often draft i was accepted.
        proposed_at: per draft position, how often a stream's cycle drafted
            draft i for it to accept (checked or not: a draft after a
            rejected one, or after the stream's last token, was still
            proposed), so accepted_at <= reached <= proposed_at position by position.
    """

    depth: int = 0
    stream_cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    proposed_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.reached:
            self.reached = [0] * self.depth
        if not self.accepted_at:
            self.accepted_at = [0] * self.depth
        if not self.proposed_at:
            self.proposed_at = [0] * self.depth

    def record(self, checked: int, accepted: int, proposed: int = 0) -> None:
        """One stream's cycle: drafts 1..proposed were drafted for it, 1..checked checked, 1..accepted accepted."""
        for j in range(min(proposed, len(self.proposed_at))):
            self.proposed_at[j] += 1
        if checked <= 0:
            return
        self.stream_cycles += 1
        self.drafted += checked
        self.accepted += accepted
        for j in range(checked):
            self.reached[j] += 1
        for j in range(accepted):
            self.accepted_at[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        """accepted_at[i] / reached[i] for draft positions 1..K (0.0 where never reached)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per stream per cycle (a cycle commits this + 1 tokens)."""
        return self.accepted / self.stream_cycles if self.stream_cycles else 0.0


__all__ = ["DraftStats"]
