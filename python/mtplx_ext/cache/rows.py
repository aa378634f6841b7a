"""A batch's device row state as one typed object: taken out, gathered, loaded back.

Continuous batching moves streams between batches of different shapes. A
stream's device state is its rows of three kinds of cache layer:

* `RaggedPositions` (shared by the KV layers of one cache list): each row's
  end slot;
* `RaggedKVCache`: the row's keys and values, [B, H, S, D] with S slots;
* `ArraysCache` (recurrent layers: gated-delta state, conv state): fixed-size
  leaves per row.

`RowState.take` reads them out of cache lists (in layer order; any layer may
be recurrent, so the positions come from the KV layers wherever they are),
`RowState.gather` builds one state from row subsets of several (KV buffers
cut or zero-padded to a new slot capacity; recurrent rows move as they are),
and `load_into` writes a state into another batch's caches of the same
layout without rebuilding them (a compiled step bound to those caches stays
valid).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from mtplx_ext.cache.ragged import RaggedKVCache, RaggedPositions

CacheLists = Sequence[Sequence[Any]]


def split_layers(cache_lists: CacheLists) -> tuple[list[RaggedPositions], list[RaggedKVCache], list[ArraysCache]]:
    """(the distinct shared positions, the KV layers, the recurrent layers) of cache lists, in layer order.

    Raises:
        ValueError: a layer that is neither ragged KV nor recurrent (naming it).
    """
    positions: list[RaggedPositions] = []
    kv: list[RaggedKVCache] = []
    rec: list[ArraysCache] = []
    for i, caches in enumerate(cache_lists):
        for j, c in enumerate(caches):
            if isinstance(c, RaggedKVCache):
                kv.append(c)
                if all(p is not c.positions for p in positions):
                    positions.append(c.positions)
            elif isinstance(c, ArraysCache):
                rec.append(c)
            else:
                raise ValueError(f"cache layer {i}.{j} ({type(c).__name__}) is neither ragged KV nor recurrent")
    return positions, kv, rec


def fit_capacity(a: mx.array, cap: int) -> mx.array:
    """[B, H, S, D] KV buffer with S slots cut or zero-padded to `cap`."""
    S = a.shape[2]
    if S == cap:
        return a
    if S > cap:
        return a[:, :, :cap]
    return mx.pad(a, [(0, 0), (0, 0), (0, cap - S), (0, 0)])


def concat_rows(parts: Sequence[tuple[Any, mx.array | None]], get: Callable[[Any], mx.array]) -> mx.array:
    """`get(part)`'s chosen rows of each (part, row indices or None for all), concatenated in order; one whole
    part is taken as it is, without a copy (a batch made of one prefill's rows)."""
    if len(parts) == 1 and parts[0][1] is None:
        return get(parts[0][0])
    return mx.concatenate([get(p) if idx is None else get(p)[idx] for p, idx in parts], axis=0)


@dataclass
class RowState:
    """The device rows of a batch's cache lists.

    Attributes:
        ends: [B] end slots, one array per distinct `RaggedPositions`.
        kv: the stored arrays of each KV layer (`RaggedKVCache.buffers`:
            keys and values, or their quantized parts), [B, H, S, X] each.
        rec: the leaves of each recurrent layer, [B, ...] each.
    """

    ends: list[mx.array]
    kv: list[list[mx.array]]
    rec: list[list[mx.array]]

    @classmethod
    def take(cls, cache_lists: CacheLists) -> "RowState":
        """The rows the cache lists hold now (references, no copy)."""
        positions, kv, rec = split_layers(cache_lists)
        return cls([p.ends for p in positions], [c.buffers for c in kv], [list(c.cache) for c in rec])

    @staticmethod
    def release(cache_lists: CacheLists) -> None:
        """Drops the cache lists' references to their buffers (the rows live on wherever taken)."""
        _, kv, rec = split_layers(cache_lists)
        for c in kv:
            c.buffers = None
        for c in rec:
            c.cache = [None] * len(c.cache)

    def load_into(self, cache_lists: CacheLists, rows: int, capacity: int) -> None:
        """Makes the cache lists hold these `rows` rows (same layout; KV buffers of `capacity` slots).

        Past its prompt a row needs no padding mask, so the recurrent layers'
        padding and lengths are cleared (a compiled step binds them so).
        """
        positions, kv, rec = split_layers(cache_lists)
        if (len(positions), len(kv), len(rec)) != (len(self.ends), len(self.kv), len(self.rec)):
            raise ValueError("RowState.load_into: the cache lists have another layout than these rows")
        last = mx.full((rows, 1), capacity - 1, mx.int32)
        for p, ends in zip(positions, self.ends):
            p.load(ends, last)
        for c, arrays in zip(kv, self.kv):
            if len(arrays) != len(c.buffers or arrays):
                raise ValueError("RowState.load_into: a KV layer stores its keys otherwise than these rows")
            c.buffers = list(arrays)
        for c, leaves in zip(rec, self.rec):
            c.cache, c.left_padding, c.lengths = list(leaves), None, None

    def arrays(self) -> list[mx.array]:
        """Every array of the state (to evaluate it)."""
        return [*self.ends, *(a for kv in self.kv for a in kv), *(a for leaves in self.rec for a in leaves)]

    @staticmethod
    def gather(parts: Sequence[tuple["RowState", mx.array | None]], capacity: int) -> "RowState":
        """One state of the chosen rows of several, in order: (state, row indices or None for all).

        One whole state is taken as it is (`concat_rows`).
        """

        def cat(get: Callable[["RowState"], mx.array]) -> mx.array:
            return concat_rows(parts, get)

        first = parts[0][0]
        return RowState(
            ends=[cat(lambda s, j=j: s.ends[j]) for j in range(len(first.ends))],
            kv=[
                [cat(lambda s, j=j, k=k: fit_capacity(s.kv[j][k], capacity)) for k in range(len(bufs))]
                for j, bufs in enumerate(first.kv)
            ],
            rec=[
                [cat(lambda s, j=j, k=k: s.rec[j][k]) for k in range(len(leaves))]
                for j, leaves in enumerate(first.rec)
            ],
        )


__all__ = ["RowState", "concat_rows", "fit_capacity", "split_layers"]
