"""What `Engine.metrics()` reports: counters, the running batch's size and KV, MTP statistics, the prefix cache.

One plain dict of numbers (and short lists / dicts of them) that a handler
thread may read while the engine thread steps: every value is copied out of
counters the engine thread alone writes, so a reading can be one step stale
(and one count against another a cycle apart: read them once the engine is
idle to compare them exactly). The server renders it as JSON (`/metrics.json`) and as
Prometheus text (`serve.metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtplx_ext.cache.rows import split_layers


def kv_bytes(cache_lists: Sequence[Sequence[Any]]) -> int:
    """Bytes the attention layers' KV buffers of `cache_lists` hold (allocated capacity, scales included)."""
    return sum(c.nbytes for c in split_layers(cache_lists)[1])


def depth_per_batch_size(depths: dict[int, int] | None, max_batch: int, depth: int) -> dict[str, int]:
    """{largest batch size a K applies to: that K}, as strings (JSON object keys).

    With depth="auto" or {batch size: K} a batch of B rows runs the K of the
    smallest listed size >= B (`depths.depth_for`); a fixed K is one entry,
    `max_batch`, covering every size.
    """
    if depths is None:
        return {str(max_batch): depth}
    return {str(b): int(k) for b, k in sorted(dict(depths).items())}


def snapshot(engine: Any, *, waiting: int, depths: dict[int, int] | None) -> dict[str, Any]:
    """`Engine.metrics()`: the engine's public counters plus what only it knows (`waiting`, the K per size).

    Keys beyond the counters: `live_streams` (still decoding), `batch_rows`
    (rows of the running batch, finished ones not dropped yet), `waiting`, `kv_slots`,
    `kv_bytes` (of the running batch), `max_batch`, `max_kv_slots`, `depth`
    (the deepest K; 0 without MTP), `batch_depth` (the running batch's K),
    `depth_per_batch_size`, `cycles`, `stream_cycles`, the draft counts per
    position 1..depth (`drafts_proposed`, `drafts_checked`,
    `drafts_accepted`), the ratios derived from them (`acceptance`,
    `acceptance_per_depth`, `mean_accepted_length`), and the prefix cache's
    `prefix_*` numbers.
    """
    s = engine.stats
    mtp = bool(engine.mtp)
    return {
        **engine.counters, "live_streams": engine.live_streams, "batch_rows": engine.batch_rows, "waiting": waiting,
        "kv_slots": engine.kv_slots, "kv_bytes": engine.kv_bytes,
        "max_batch": engine.max_batch, "max_kv_slots": engine.max_kv_slots,
        "depth": engine.depth if mtp else 0, "batch_depth": engine.cycle_depth if mtp else 0,
        "depth_per_batch_size": depth_per_batch_size(depths, engine.max_batch, engine.depth if mtp else 0),
        "cycles": s.cycles, "stream_cycles": s.stream_cycles,
        "drafts_proposed": list(s.proposed_at), "drafts_checked": list(s.reached),
        "drafts_accepted": list(s.accepted_at),
        "acceptance": s.acceptance_rate, "acceptance_per_depth": s.acceptance_per_depth,
        "mean_accepted_length": s.mean_accepted_length,
        **engine.prefix.metrics(),
    }


__all__ = ["depth_per_batch_size", "kv_bytes", "snapshot"]
