"""Rollback of mlx-lm cache lists: recurrent snapshots, KV trim, checkpoints.

A decode cycle that rejects a draft must undo one verification forward. The
caches of a trunk split in two kinds:

* trimmable caches (`KVCache`, `BatchKVCache`, ...): undone by `trim_kv`
  for the whole batch, or per stream by `rollback_streams` (`RaggedKVCache`);
* recurrent caches (`ArraysCache` and subclasses, e.g. gated-delta or Mamba
  state): their state cannot be trimmed, so `snapshot_recurrent` copies
  every leaf of every recurrent layer in ONE `snapshot_state` primitive
  before the forward and `restore_recurrent` writes them back in ONE
  `restore_state` primitive.

`checkpoint_caches` / `rollback_caches` are a different, host-only tool:
they undo graph *building* that was never evaluated (the pipelined loop
builds the next cycle before it knows whether this one is accepted).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList

from mtplx_ext.cache.ragged import RaggedKVCache
from mtplx_ext.ops.state_copy import restore_state, snapshot_state


def _flat(caches: Sequence[Any]) -> Iterator[tuple[str, Any]]:
    """Yields (name, cache) for every leaf cache, looking inside CacheList."""
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence):
        raise TypeError(f"caches must be a list of mlx-lm cache objects, got {type(caches).__name__}")
    for i, c in enumerate(caches):
        if isinstance(c, CacheList):
            for j, sub in _flat(c.caches):
                yield f"{i}.{j}", sub
        else:
            yield str(i), c


def is_recurrent_cache(cache: Any) -> bool:
    """Whether a cache holds recurrent state that cannot be trimmed."""
    return isinstance(cache, ArraysCache)


def is_trimmable_cache(cache: Any) -> bool:
    """Whether a cache can drop its last tokens (a KV cache that can trim now)."""
    if is_recurrent_cache(cache) or not hasattr(cache, "trim"):
        return False
    return bool(cache.is_trimmable())


def has_recurrent_state(caches: Sequence[Any]) -> bool:
    """Whether any layer of a cache list is recurrent."""
    return any(is_recurrent_cache(c) for _, c in _flat(caches))


def _alias(value: Any) -> Any:
    # A new handle on the same array data: costs nothing, and keeps the old
    # value when the cache later updates the array in place (`a[...] = v`,
    # `a -= n`), which rewrites only the handle the cache holds.
    return mx.array(value) if isinstance(value, mx.array) else value


@dataclass
class RecurrentSnapshot:
    """Copies of the recurrent leaves of a cache list, taken before a forward.

    Attributes:
        slots: (cache, slot index) of each copied leaf, in `arrays` order.
        arrays: the device copies (lazy until needed: a cycle that accepts
            drops them unevaluated, so the copy costs nothing).
        empty_slots: (cache, slot index) of leaves that were still None.
        extras: (cache, attribute, value) of the padding bookkeeping
            (`left_padding`, `lengths`) that `advance` changes in place.
    """

    slots: list[tuple[Any, int]] = field(default_factory=list)
    arrays: list[mx.array] = field(default_factory=list)
    empty_slots: list[tuple[Any, int]] = field(default_factory=list)
    extras: list[tuple[Any, str, Any]] = field(default_factory=list)


def snapshot_recurrent(caches: Sequence[Any]) -> RecurrentSnapshot:
    """Snapshots every recurrent layer's state in one primitive call.

    Args:
        caches: the trunk's cache list (trimmable layers are skipped).

    Returns:
        A `RecurrentSnapshot` for `restore_recurrent`.
    """
    snap = RecurrentSnapshot()
    live: list[mx.array] = []
    for _, c in _flat(caches):
        if not is_recurrent_cache(c):
            continue
        for k, leaf in enumerate(c.cache):
            if leaf is None:
                snap.empty_slots.append((c, k))
            else:
                snap.slots.append((c, k))
                live.append(leaf)
        for attr in ("left_padding", "lengths"):
            snap.extras.append((c, attr, _alias(getattr(c, attr, None))))
    if live:
        snap.arrays = snapshot_state(live)
    return snap


def restore_recurrent(caches: Sequence[Any], snapshot: RecurrentSnapshot) -> None:
    """Writes a snapshot back into the recurrent layers, in one primitive call.

    Args:
        caches: the cache list the snapshot was taken from.
        snapshot: from `snapshot_recurrent`.

    Raises:
        ValueError: if a snapshotted layer no longer holds state.
    """
    live = []
    for c, k in snapshot.slots:
        if c.cache[k] is None:
            raise ValueError(f"caches: recurrent slot {k} was emptied after the snapshot")
        live.append(c.cache[k])
    if live:
        restored = restore_state(live, snapshot.arrays)
        for (c, k), a in zip(snapshot.slots, restored):
            c.cache[k] = a
    for c, k in snapshot.empty_slots:
        c.cache[k] = None
    for c, attr, value in snapshot.extras:
        setattr(c, attr, _alias(value))


def recurrent_leaves(caches: Sequence[Any]) -> list[mx.array]:
    """The state arrays of every recurrent layer, in layer order (None skipped)."""
    return [
        leaf
        for _, c in _flat(caches)
        if is_recurrent_cache(c)
        for leaf in c.cache
        if leaf is not None
    ]


def recurrent_caches(caches: Sequence[Any]) -> list[Any]:
    """The recurrent layers' caches, in layer order."""
    return [c for _, c in _flat(caches) if is_recurrent_cache(c)]


def trim_kv(caches: Sequence[Any], n: int) -> None:
    """Drops the last `n` tokens of every trimmable layer.

    Recurrent layers are left alone (restore them with `restore_recurrent`).

    Raises:
        ValueError: if a non-recurrent layer cannot trim `n` tokens (a
            rotating cache that has wrapped, or a shorter cache).
    """
    for name, c in _flat(caches):
        if is_recurrent_cache(c):
            continue
        if not is_trimmable_cache(c):
            raise ValueError(f"caches[{name}] ({type(c).__name__}) cannot be trimmed")
        if c.trim(n) != n:
            raise ValueError(f"caches[{name}] holds fewer than {n} tokens to trim")


def rollback_streams(caches: Sequence[Any], counts: mx.array) -> None:
    """Drops the last counts[b] tokens of stream b in every layer (device-side).

    Args:
        caches: a cache list whose layers are all `RaggedKVCache`.
        counts: [B] int tokens to drop per stream (a device array: nothing
            is read on the host).

    Raises:
        ValueError: naming a layer that cannot roll streams back on their own.
    """
    flat = list(_flat(caches))
    for name, c in flat:
        if not isinstance(c, RaggedKVCache):
            raise ValueError(f"caches[{name}] ({type(c).__name__}) cannot roll back single streams")
    for _, c in flat:
        c.rollback(counts)


def commit_streams(caches: Sequence[Any], accepted: mx.array, depth: int, capture: Any) -> None:
    """Per-stream commit of a captured [B, depth + 1] verification (device-side).

    Stream b keeps its first accepted[b] + 1 new tokens: KV layers drop the
    other depth - accepted[b] slots (`RaggedKVCache.rollback`), recurrent
    layers take the recurrent state captured after token accepted[b] and the
    conv window of the convolution input ending there. Nothing is re-run and
    nothing is read on the host.

    Args:
        caches: the trunk's caches: `RaggedKVCache` and `ArraysCache` layers.
        accepted: [B] int accepted drafts per stream, in [0, depth].
        depth: drafts of the verification (it forwarded depth + 1 tokens).
        capture: the forward's `gated_delta.Capture` (unused without
            recurrent layers).

    Raises:
        ValueError: naming a layer that cannot commit per stream.
        KeyError: a recurrent layer the capture did not record.
    """
    flat = list(_flat(caches))
    for name, c in flat:
        if not isinstance(c, RaggedKVCache) and not (is_recurrent_cache(c) and capture is not None):
            raise ValueError(f"caches[{name}] ({type(c).__name__}) cannot commit single streams")
    n = accepted.astype(mx.int32)
    dropped = depth - n
    for _, c in flat:
        if isinstance(c, RaggedKVCache):
            c.rollback(dropped)
            continue
        lc = capture.of(c)
        keep = c[0].shape[1]  # conv window: kernel size - 1 inputs
        rows = (n + 1)[:, None] + mx.arange(keep, dtype=mx.int32)[None]
        c[0] = mx.take_along_axis(lc.conv_input, rows[..., None], axis=1)
        # Whole-row gather of [B * T, ...] (one contiguous state per stream):
        # about 10x faster than take_along_axis over the T axis on the CPU.
        B, T = lc.states.shape[:2]
        flat = lc.states.reshape((B * T,) + tuple(lc.states.shape[2:]))
        c[1] = mx.take(flat, mx.arange(B, dtype=mx.int32) * T + n, axis=0)


def finish_prefill(caches: Sequence[Any]) -> None:
    """Ends the prompt phase of batch caches (mlx-lm's `finalize` protocol).

    After a left-padded prefill every pad position has been consumed, so
    recurrent layers drop their padding mask (they then run unmasked
    kernels); KV caches keep theirs, since padded keys stay in the cache.
    """
    for _, c in _flat(caches):
        if hasattr(c, "finalize"):
            c.finalize()


@dataclass
class CacheCheckpoint:
    """Host-side copy of the Python state of caches, to undo graph building."""

    saved: list[tuple[Any, dict[str, Any]]]


def checkpoint_caches(*cache_lists: Sequence[Any]) -> CacheCheckpoint:
    """Records the caches' attributes so unevaluated updates can be dropped.

    Costs no device work: arrays are recorded as new handles on the same
    data. Release the checkpoint (drop it) before evaluating the new graph,
    so MLX can still update the cache buffers in place.

    Args:
        *cache_lists: cache lists (trunk, head, ...), or lists of other
            objects whose attributes graph building updates (a token
            policy's state).

    Returns:
        A checkpoint for `rollback_caches`.
    """
    saved = []
    for caches in cache_lists:
        for _, c in _flat(caches):
            state = {}
            for k, v in vars(c).items():
                if isinstance(v, list):
                    v = [_alias(x) for x in v]
                state[k] = _alias(v)
            saved.append((c, state))
    return CacheCheckpoint(saved)


def rollback_caches(checkpoint: CacheCheckpoint) -> None:
    """Puts the caches back to a checkpoint, dropping the graph built since.

    Only valid while nothing built after the checkpoint has been evaluated.
    """
    for c, state in checkpoint.saved:
        for k, v in state.items():
            setattr(c, k, list(v) if isinstance(v, list) else v)
    checkpoint.saved = []
