"""What a batched decode returns: per-stream tokens and the decode's statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamResult:
    """One stream's generated tokens.

    Attributes:
        tokens: committed token ids (a final stop token is kept).
        finish_reason: "stop" (a stop token was committed) or "length"
            (max_new_tokens reached).
    """

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class BatchedDecodeResult:
    """Tokens and statistics of one batched decode.

    Attributes:
        streams: one `StreamResult` per prompt, in prompt order.
        depth: drafts per cycle (K; 0 for plain decoding).
        cycles: decode cycles, each ending in one bundle read.
        forwards: trunk forwards during decode: verification and repair
            forwards (MTP), or one per token after the first (plain
            decoding). The prefill is not counted.
        repair_cycles: cycles that ran a repair forward.
        drafted: drafts whose verdict mattered (reached[i] summed).
        accepted: those drafts that were accepted (committed).
        reached: per draft position i = 1..K, how often draft i was
            checked (every earlier draft of its cycle accepted, and the
            stream still going on).
        accepted_at: per draft position, how often draft i was accepted.
        stream_cycles: (stream, cycle) pairs that verified drafts.
        host_syncs: blocking host reads during decode (one per cycle).
        sync_wait_s: seconds the host spent blocked in those reads (the
            rest of decode_s is host work the device did not hide).
        compiled: whether the decode steps ran through `mx.compile`.
        prefill_s: seconds from the call to the end of the prefill.
        decode_s: seconds of the decode cycles.
    """

    streams: list[StreamResult]
    depth: int = 0
    cycles: int = 0
    forwards: int = 0
    repair_cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    stream_cycles: int = 0
    host_syncs: int = 0
    sync_wait_s: float = 0.0
    compiled: bool = False
    prefill_s: float = 0.0
    decode_s: float = 0.0

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

    @property
    def generated_tokens(self) -> int:
        """Tokens committed over all streams."""
        return sum(len(s.tokens) for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        """Committed tokens over all streams per second of decode."""
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0
