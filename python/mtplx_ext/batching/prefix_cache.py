"""Prompt prefix cache: a request whose prompt starts like an earlier one reuses that prefix's KV.

Agents and chat clients resend the whole conversation every turn; without
this every turn prefills everything again. After a prefill the engine stores
the prompt's KV (the trunk's attention layers and the MTP head's), and when a
request finishes, its prompt's and reply's; a later prompt sharing its first L tokens with a stored one
gets the first m = L - 1 positions of both loaded into its fresh caches and
prefills only the rest. m stops one short of L because the head's next pair
needs the trunk's hidden state at position m, which the resumed forward
computes; the head's stored pairs (hidden at t, token t + 1) for t < m are
those of the shared tokens.

Entries are kept least recently used first out within `max_bytes`. Only the
engine's thread touches the cache. Trunks with recurrent layers (their state
at the boundary is not stored) and heads of several MTP modules are not
cached: `supported` says so and the engine then prefills as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext.cache.rows import RowState, fit_capacity, split_layers


@dataclass
class Entry:
    """A stored prompt: its tokens and the KV of every attention layer (its `buffers`, [1, H, n, X] each)."""

    tokens: np.ndarray
    kv: list[list[mx.array]]
    nbytes: int


class PrefixCache:
    """LRU store of prompt KV, within `max_bytes`.

    Args:
        max_bytes: most bytes of stored KV (0 turns the cache off).
        min_tokens: the least shared prefix worth loading instead of prefilling.
    """

    def __init__(self, max_bytes: int, min_tokens: int = 8):
        self.max_bytes = int(max_bytes)
        self.min_tokens = int(min_tokens)
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.bytes = 0
        self.stats = {"prefix_lookups": 0, "prefix_hits": 0, "prefix_tokens_reused": 0, "prefix_evictions": 0}

    @staticmethod
    def supported(runtime: Any) -> bool:
        """Whether this runtime's caches can be resumed from a stored prefix."""
        recurrent = bool(getattr(runtime, "has_recurrent_layers", True))
        return not recurrent and len(getattr(runtime, "mtp_modules", []) or []) <= 1

    def lookup(self, prompt: Sequence[int]) -> tuple[Entry | None, int]:
        """The stored entry sharing the longest prefix with `prompt`, and how many positions to load (m)."""
        if self.max_bytes <= 0:
            return None, 0
        self.stats["prefix_lookups"] += 1
        p = np.asarray(prompt, dtype=np.int64)
        best, best_m = None, 0
        for key, e in self._entries.items():
            n = min(len(e.tokens), len(p))
            diff = np.flatnonzero(e.tokens[:n] != p[:n])
            common = int(diff[0]) if diff.size else n
            m = min(common - 1, len(p) - 1, len(e.tokens) - 1)
            if m > best_m:
                best, best_m, best_key = e, m, key
        if best is None or best_m < self.min_tokens:
            return None, 0
        self._entries.move_to_end(best_key)
        self.stats["prefix_hits"] += 1
        self.stats["prefix_tokens_reused"] += best_m
        return best, best_m

    def store(self, tokens: Sequence[int], cache_lists: Sequence[Sequence[Any]], row: int = 0) -> None:
        """Keeps row `row`'s KV of `tokens` (a copy, cut to the positions every layer holds).

        `tokens` are the row's prompt and committed tokens; position t of
        every attention layer must hold token t (the trunk's KV) and the pair
        (hidden at t, token t + 1) (the head's), for t below the layers'
        end slots. The entry keeps the n positions all layers hold and the
        n + 1 tokens they cover.
        """
        if self.max_bytes <= 0:
            return
        positions, kv, _ = split_layers(cache_lists)
        ends = [int(np.array(p.ends)[row]) for p in positions]
        n = min([*ends, len(tokens) - 1])
        if n < self.min_tokens:
            return
        # Copies (a slice would keep the whole capacity-sized buffer alive).
        layers = [[mx.contiguous(a[row : row + 1, :, :n]) for a in c.buffers] for c in kv]
        nbytes = sum(a.nbytes for parts in layers for a in parts)
        if nbytes > self.max_bytes:
            return
        mx.eval([a for pair in layers for a in pair])
        toks = np.asarray(list(tokens)[: n + 1], dtype=np.int64)
        key = toks.tobytes()
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._entries[key] = Entry(toks, layers, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.nbytes
            self.stats["prefix_evictions"] += 1

    @staticmethod
    def load(entry: Entry, m: int, cache_lists: Sequence[Sequence[Any]], capacity: int) -> None:
        """Makes fresh one-row caches hold the first m positions of `entry` (KV buffers of `capacity` slots)."""
        positions, kv, rec = split_layers(cache_lists)
        state = RowState(
            ends=[mx.array([m], dtype=mx.int32) for _ in positions],
            kv=[[fit_capacity(a[:, :, :m], capacity) for a in parts] for parts in entry.kv],
            rec=[list(c.cache) for c in rec],
        )
        state.load_into(cache_lists, 1, capacity)

    def metrics(self) -> dict[str, Any]:
        """Counters, entries, bytes and the hit rate (hits / lookups)."""
        s = self.stats
        return {**s, "prefix_entries": len(self._entries), "prefix_bytes": self.bytes,
                "prefix_hit_rate": s["prefix_hits"] / s["prefix_lookups"] if s["prefix_lookups"] else 0.0}


__all__ = ["Entry", "PrefixCache"]
