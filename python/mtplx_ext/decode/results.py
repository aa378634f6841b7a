"""What a batched decode returns: per-stream tokens and the decode's statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtplx_ext.decode.stats import DraftStats


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


@dataclass(kw_only=True)
class BatchedDecodeResult(DraftStats):
    """Tokens and statistics of one batched decode.

    Attributes (besides `DraftStats`' acceptance counts):
        streams: one `StreamResult` per prompt, in prompt order.
        cycles: decode cycles, each ending in one bundle read (the
            prefill and its first token are not a cycle).
        forwards: trunk forwards during decode: verification and repair
            forwards (MTP), or one per token after the first (plain
            decoding). The prefill is not counted.
        repair_cycles: cycles that ran a repair forward.
        host_syncs: blocking host reads during decode (one per cycle).
        sync_wait_s: seconds the host spent blocked in those reads (the
            rest of decode_s is host work the device did not hide).
        compiled: whether the decode steps ran through `mx.compile`.
        prefill_s: seconds from the call to the end of the prefill.
        decode_s: seconds of the decode cycles.
        mask_s: host seconds of those spent on constraint masks (advance,
            mask, roll back; 0 without constraints).
        row_cycles: rows of the batch summed over the cycles (a compacted
            batch runs fewer rows; `engine.compaction`).
        compactions: how many times the batch dropped its finished rows.
    """

    streams: list[StreamResult] = field(default_factory=list)
    cycles: int = 0
    forwards: int = 0
    repair_cycles: int = 0
    host_syncs: int = 0
    sync_wait_s: float = 0.0
    compiled: bool = False
    prefill_s: float = 0.0
    decode_s: float = 0.0
    mask_s: float = 0.0
    row_cycles: int = 0
    compactions: int = 0

    @property
    def generated_tokens(self) -> int:
        """Tokens committed over all streams."""
        return sum(len(s.tokens) for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        """Committed tokens over all streams per second of decode."""
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0
