"""Row compaction of a fixed batch: finished streams stop costing forwards.

A fixed batch runs until its slowest stream is done, and with MTP streams
finish at different cycles (each accepts its own drafts), with stop tokens
at very different ones. Every forward still computes the finished rows: on
a memory-bound model a verification of B x (K + 1) rows costs about what
it costs for the live rows alone only while B x (K + 1) is small, and the
rows beyond that are FMA work on the CPU (and on a GPU once the batch is
large).

`Compactor` halves the batch whenever at most half of its rows are live:
between two cycles, with none in flight, it gathers the live rows (and
finished ones up to a power of two, so that decodes meet the same few row
counts and each is traced once, not once per live count) and their cache
state (`cache.rows.RowState`, left padding kept), their next cycle's
tokens and draft info into fresh caches of the same capacity and a new
`Cycle`, whose compiled steps are the same kinds retraced once for the new
row count (and kept, like every compiled step, for the next decode). At
most log2(B) - 1 compactions per decode: batches under `MIN_ROWS` rows
stay as they are. Each row's tokens do not change: a
stream's forwards see only its own rows.

A runtime (or a wrapper of one) that keeps per-row state outside its
caches implements `keep_rows(rows)` (an [n] int32 array of the batch's
rows that go on, in order): it returns the runtime for those rows (a new
object; the decode's own runtime stays as it was).

The streams keep their indices: the compacted batch's bundle is spread
back to one row per stream (`expand`) before the host reads it, and rows
of finished streams stay zero there (never read).

Scope: compiled steps with per-stream commit or plain decoding, and a
greedy policy without per-row device state (no logit bias, no grammar
mask): a sampled policy's per-row generators and penalty counts are not
moved (those batches keep their rows).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext.cache.rows import RowState, split_layers
from mtplx_ext.decode.cycle import Cycle, Pending
from mtplx_ext.decode.policies import GreedyPolicy

#: Batches of fewer rows are not compacted (and a compaction keeps at least half this many).
MIN_ROWS = 4


def compactable(policy: Any, compiled: bool, mtp: bool, per_stream: bool) -> bool:
    """Whether a decode with this policy and mode can compact its rows."""
    plain_greedy = type(policy) is GreedyPolicy and not any(getattr(policy, a, None) is not None
                                                             for a in policy.state_attrs)
    return compiled and (per_stream or not mtp) and plain_greedy


class Compactor:
    """Owns a fixed batch's current `Cycle` and which stream each of its rows is.

    Args:
        runtime: the `MTPRuntime`.
        cyc: the decode's cycle (compiled steps).
        pads: each stream's left padding (the prompt slots before its prompt).
        depth: drafts per cycle (K), 0 for plain decoding.
    """

    def __init__(self, runtime: Any, cyc: Cycle, pads: list[int], depth: int):
        self.rt = runtime
        self.cyc = cyc
        self.pads = list(pads)
        self.depth = depth
        self.rows = np.arange(len(pads))  # stream index of each row of the batch
        self.compactions = 0

    def due(self, done: np.ndarray) -> bool:
        """At most half of the batch's rows still decode (at least one), and the batch has 4 rows or more.

        Below 4 rows a forward costs about what one row's does (the weights'
        stream), so a halving would buy little and cost a trace.
        """
        live = int(np.count_nonzero(~done[self.rows]))
        return len(self.rows) >= MIN_ROWS and 0 < live <= len(self.rows) // 2

    def expand(self, b: np.ndarray, streams: int) -> np.ndarray:
        """A bundle of the batch's rows as one row per stream (finished streams' rows zero)."""
        if len(self.rows) == streams:
            return b
        full = np.zeros((streams,) + b.shape[1:], dtype=b.dtype)
        full[self.rows] = b
        return full

    def compact(self, p: Pending, done: np.ndarray) -> Pending:
        """Moves the live rows into a new batch; returns `p` (read, not yet followed) for those rows.

        `p` must be the last launched cycle, its bundle read: nothing in flight.
        """
        live = ~done[self.rows]
        # A power of two of rows (finished ones fill the rest): every decode
        # compacts through the same few row counts, each traced once.
        n_live = int(np.count_nonzero(live))
        n = max(MIN_ROWS // 2, 1 << (n_live - 1).bit_length())
        keep = np.sort(np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)[: n - n_live]]))
        idx = mx.array(keep, dtype=mx.int32)
        old = self.cyc
        positions = split_layers(old.caches())[0]
        if not positions or positions[0].capacity is None:
            raise RuntimeError("row compaction needs fixed-capacity ragged caches")
        cap = int(positions[0].capacity)
        state = RowState.gather([(RowState.take(old.caches()), idx)], cap)
        streams = self.rows[keep]
        pads = [self.pads[int(s)] for s in streams]
        cache = self.rt.make_cache(pads, ragged=True, capacity=cap)
        head = None
        if old.head_cache is not None:
            head = self.rt.make_head_cache(pads, ragged=True, capacity=cap, depth=self.depth)
        nxt = Pending(
            p.bundle[idx],
            next_tokens=None if p.next_tokens is None else p.next_tokens[idx],
            next_info=None if p.next_info is None else p.next_info[idx],
        )
        mx.eval(state.arrays(), [a for a in (nxt.bundle, nxt.next_tokens, nxt.next_info) if a is not None])
        keep_rows = getattr(self.rt, "keep_rows", None)
        if keep_rows is not None:
            self.rt = keep_rows(idx)
        old.release()  # its compiled steps are rebound to the new caches below
        RowState.release(old.caches())
        new = Cycle(self.rt, GreedyPolicy(), cache, head, self.depth, old.per_stream, old.logprobs)
        state.load_into(new.caches(), len(keep), cap)
        new.compile_steps()
        self.cyc, self.rows = new, streams
        self.compactions += 1
        return nxt


__all__ = ["Compactor", "compactable"]
