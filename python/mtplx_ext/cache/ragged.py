"""RaggedKVCache: a batch KV cache whose streams may end at different slots.

mlx-lm's `BatchKVCache` writes every stream at the same slot, so after a
verification forward in which some streams accepted their draft and others
did not, the only way to drop the rejected drafts is a uniform trim and a
re-forward of the whole batch. Here each stream keeps its own end slot on
the device: rolling a rejected stream back is one subtraction (no copy, no
forward), and because the ends never leave the device, the next cycle can
be built before the host has read this one.

Layout of stream b: slots [0, left_padding[b]) are prompt padding, slots
[left_padding[b], ends[b]) its tokens; slots from ends[b] up to `size()`
hold dropped drafts or nothing and are masked out (the next write to the
stream overwrites them). `size()` is a host-side upper bound of the ends.

With a fixed `capacity` the buffers are allocated once and every forward
attends over all of them (masked): shapes never change, so a decode step
can be `mx.compile`d and replayed (`mtplx_ext.cache.compiled_step`).

The layers of one model advance in lockstep, so they share one
`RaggedPositions`: the write slots, RoPE offsets and mask of a forward are
built once for all layers instead of once per layer (on MLX's CPU backend a
small decode forward is bound by the number of graph nodes).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import _BaseCache

from mtplx_ext._checks import as_int


class RaggedPositions:
    """Per-stream end slots shared by the layers of one cache list.

    Every change (a forward's writes, a rollback, a trim) is applied by the
    first layer that makes it and followed by the others: `tick` counts the
    changes and each layer remembers the last one it took part in, so the
    mlx-lm idiom of calling `trim` on every layer trims once.
    """

    def __init__(self, left_padding: list[int], capacity: int | None = None):
        capacity = None if capacity is None else as_int("capacity", capacity, lo=1)
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        self.ends = mx.zeros((len(left_padding),), dtype=mx.int32)
        self.capacity = capacity
        # An array, not a Python scalar, so that a compiled step can take it
        # as an input instead of baking the capacity into its fused kernels.
        self.last_slot = None if capacity is None else mx.full((len(left_padding), 1), capacity - 1, mx.int32)
        self.idx = 0  # host upper bound of the ends
        # False once a compiled step owns these positions: replays move the
        # ends without Python, so `idx` no longer bounds them (the caller
        # reserves capacity, and writes past it are clamped on the device).
        self.host_bound = True
        # True once streams may end at different slots; with a fixed capacity
        # writes always go through the device-side ends (replayable).
        self.ragged = capacity is not None
        self.tick = 0
        self.below_zero = False  # rows may write below slot 0 (`move_rows_left`)
        self._offset: mx.array | None = None
        # The change that led to `tick`: (kind, argument), and for a forward
        # (slot before, write index [B, 1, T, 1] or None, offsets before).
        self.last_change: tuple[str, Any] | None = None
        self.last_forward: tuple[int, mx.array | None, mx.array] | None = None

    def move_rows_left(self, pads: list[int]) -> None:
        """Makes row b's slots start pads[b] further left (call before the first forward).

        With `pads` the rows' left padding of a left-padded prefill, each row
        keeps its first real token at slot 0 (a layer whose positions pair
        the token j past t keeps j slots: left padding pads + j becomes j).
        Each row's end starts at minus its shift and the left padding drops by
        it: RoPE offsets (ends - left padding) and masks are those of the
        padded layout, moved, so every token computes what it would there. The
        padding's own writes (negative slots) go to the last slot, which no
        query of a row sees before the row writes its own token there. So a
        left-padded prefill leaves rows laid out as a batch's rows are, without
        a shift of their keys and values.

        Raises:
            ValueError: without a fixed capacity, after a forward, or a shift past a row's left padding.
        """
        if self.capacity is None or self.tick:
            raise ValueError("move_rows_left needs fixed-capacity positions before their first forward")
        shift = mx.array(list(pads), dtype=mx.int32)
        if shift.shape != self.left_padding.shape or bool(mx.any(shift > self.left_padding)):
            raise ValueError(f"pads must give each row a shift of at most its left padding, got {list(pads)}")
        self.ends, self.left_padding = self.ends - shift, self.left_padding - shift
        self.below_zero = True
        self._offset = None

    def set_capacity(self, capacity: int) -> None:
        """Raises a fixed capacity (the layers' buffers must grow with it: `RaggedKVCache.grow`)."""
        if self.capacity is None or capacity < self.capacity:
            raise ValueError(f"capacity can only grow from a fixed capacity: {self.capacity} -> {capacity}")
        self.capacity = capacity
        self.last_slot = mx.full(self.last_slot.shape, capacity - 1, mx.int32)

    def load(self, ends: mx.array, last_slot: mx.array | None, left_padding: mx.array | None = None) -> None:
        """Takes device state from outside (a compiled step's inputs or outputs)."""
        self.ends, self.last_slot = ends, last_slot
        if left_padding is not None:
            self.left_padding = left_padding
        self._offset = None  # derived from the old ends

    def offset(self) -> mx.array:
        """[B] RoPE position of each stream's next token (built once per tick)."""
        if self._offset is None:
            self._offset = self.ends - self.left_padding
        return self._offset

    def apply(self, kind: str, arg: Any) -> None:
        """Makes a change: ("forward", T), ("rollback", counts) or ("trim", n)."""
        if kind == "forward":
            if self.capacity is not None and self.host_bound and self.idx + arg > self.capacity:
                raise ValueError(
                    f"RaggedKVCache capacity exceeded: {self.idx} + {arg} slots > capacity {self.capacity}"
                )
            write = None
            if self.ragged:
                write = self.ends[:, None] + mx.arange(arg, dtype=mx.int32)
                if self.capacity is not None:
                    # Replayed steps never re-check the host bound: a stream
                    # past the capacity (finished, still computed) writes its
                    # last slot again instead of outside its buffer.
                    write = mx.minimum(write, self.last_slot)
                if self.below_zero:  # a padding token's write: to the last slot, seen by no query yet
                    write = mx.where(write < 0, self.last_slot, write)
                write = write[:, None, :, None]
            self.last_forward = (self.idx, write, self.offset())
            self.ends = self.ends + arg
            self.idx += arg
        elif kind == "rollback":
            self.ends = self.ends - arg.astype(mx.int32)
            self.ragged = True
        else:
            self.idx -= arg
            self.ends = self.ends - arg
        self.last_change = (kind, arg)
        self.tick += 1
        self._offset = None


def _same_change(last: tuple[str, Any] | None, kind: str, arg: Any) -> bool:
    if last is None or last[0] != kind:
        return False
    # Rollback counts are device arrays: the same array object for all layers.
    return last[1] is arg if isinstance(arg, mx.array) else last[1] == arg


class RaggedKVCache(_BaseCache):
    """Batch KV cache with a device-side end slot per stream.

    Drop-in for `BatchKVCache` in mlx-lm attention layers: `offset` (the
    RoPE position of the next token, per stream), `update_and_fetch` and
    `make_mask` (always an array mask [B, 1, N, S]). Make the caches of one
    model with `MTPRuntime.make_cache(..., ragged=True)` (or give them one
    `RaggedPositions`) so that they share their positions.

    Args:
        left_padding: per-stream count of pad tokens on the left of the
            prompts (its length is the batch size).
        positions: positions shared with the model's other layers (default:
            this layer's own).
    """

    step = 256

    def __init__(self, left_padding: list[int], positions: RaggedPositions | None = None):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.positions = RaggedPositions(left_padding) if positions is None else positions
        self._tick = self.positions.tick

    @property
    def left_padding(self) -> mx.array:
        return self.positions.left_padding

    @property
    def ends(self) -> mx.array:
        """[B] slot after each stream's last token."""
        return self.positions.ends

    @property
    def offset(self) -> mx.array:
        """[B] RoPE position of each stream's next token in this layer."""
        p = self.positions
        if self._tick == p.tick:
            return p.offset()
        return p.last_forward[2]  # a later layer of the forward that advanced

    def _change(self, kind: str, arg: Any) -> None:
        """Applies a change to the shared positions, or follows the layer that did."""
        p = self.positions
        if self._tick == p.tick:
            p.apply(kind, arg)
        elif self._tick != p.tick - 1 or not _same_change(p.last_change, kind, arg):
            raise ValueError(
                f"RaggedKVCache layers out of step: this layer's {kind} does not follow "
                f"the last change of the layers sharing its positions ({p.last_change[0]})"
            )
        self._tick = p.tick

    def _encode(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """New keys and values as this cache stores them (float: as they are)."""
        return keys, values

    def _reserve(self, end: int, like_k: Any, like_v: Any) -> None:
        cap = self.positions.capacity
        # A fixed capacity is allocated once (and grown only by `grow`).
        if self.keys is not None and (cap is not None or end <= self.slots):
            return
        have = 0 if self.keys is None else self.slots
        grow = cap if cap is not None else ((end - have + self.step - 1) // self.step) * self.step

        def empty(like: mx.array) -> mx.array:
            B, H, _, X = like.shape
            return mx.zeros((B, H, grow, X), like.dtype)

        new_k, new_v = tree_map(empty, like_k), tree_map(empty, like_v)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            cat = lambda a, b: mx.concatenate([a, b], axis=2)  # noqa: E731
            self.keys, self.values = tree_map(cat, self.keys, new_k), tree_map(cat, self.values, new_v)

    @property
    def slots(self) -> int:
        """Slots allocated per stream (0 before the first write)."""
        return 0 if self.keys is None else self.buffers[0].shape[2]

    @property
    def buffers(self) -> list[mx.array] | None:
        """Every stored array, [B, H, S, X] each with S slots (None before the first write).

        Float KV: [keys, values]; quantized KV: the keys' (packed, scales,
        biases) then the values'. Row moves, compaction, compiled steps and
        the prefix cache carry a layer as this list.
        """
        if self.keys is None:
            return None
        k, v = self.keys, self.values
        return [*k, *v] if isinstance(k, tuple) else [k, v]

    @buffers.setter
    def buffers(self, arrays: list[mx.array] | None) -> None:
        if arrays is None:
            self.keys = self.values = None
        else:
            self.keys, self.values = arrays[0], arrays[1]

    def dense(self) -> tuple[mx.array, mx.array]:
        """(keys, values) as float arrays [B, H, S, D] (dequantized when stored quantized)."""
        return self.keys, self.values

    def grow(self, capacity: int) -> None:
        """Pads the allocated buffers with empty slots up to `capacity` slots."""
        have = self.slots
        if capacity > have:
            pad = [(0, 0), (0, 0), (0, capacity - have), (0, 0)]
            grow = lambda a: mx.pad(a, pad)  # noqa: E731
            self.keys, self.values = tree_map(grow, self.keys), tree_map(grow, self.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Writes [B, H, T, D] keys/values at each stream's end; returns the visible slots."""
        p = self.positions
        T = keys.shape[2]
        self._change("forward", T)
        start, write, _ = p.last_forward
        keys, values = self._encode(keys, values)
        self._reserve(start + T, keys, values)
        if write is None:

            def put(buf: mx.array, new: mx.array) -> mx.array:
                buf[..., start : start + T, :] = new
                return buf

        else:

            def put(buf: mx.array, new: mx.array) -> mx.array:
                return mx.put_along_axis(buf, mx.broadcast_to(write, new.shape), new, axis=2)

        self.keys, self.values = tree_map(put, self.keys, keys), tree_map(put, self.values, values)
        if p.capacity is not None:
            return self.keys, self.values
        cut = lambda a: a[..., : p.idx, :]  # noqa: E731
        return tree_map(cut, self.keys), tree_map(cut, self.values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs: Any) -> mx.array:
        """[B, 1, N, S] bool: query t of stream b sees its slots up to ends[b] + t.

        S is size() + N, or the capacity when it is fixed. With `window_size`
        W (sliding-window layers) a query sees only its last W slots, itself
        included, as mlx-lm's causal mask does: the cache keeps every slot
        (it never rotates), so a stream rolled back by any count still finds
        the keys of its window.
        """
        p = self.positions
        slots = mx.arange(p.idx + N if p.capacity is None else p.capacity, dtype=mx.int32)
        query_slots = p.ends[:, None] + mx.arange(N, dtype=mx.int32)
        mask = (slots[None, None, :] <= query_slots[:, :, None]) & (slots[None, None, :] >= p.left_padding[:, None, None])
        if window_size is not None:
            window_size = as_int("window_size", window_size, lo=1)
            mask = mask & (slots[None, None, :] > query_slots[:, :, None] - window_size)
        return mask[:, None]

    def rollback(self, counts: mx.array) -> None:
        """Drops the last counts[b] tokens of each stream b ([B] int, on the device).

        Acts on the positions shared by the model's layers: the first layer
        called rolls them back, the others follow.
        """
        self._change("rollback", counts)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drops the last `n` tokens of every stream (shared as `rollback` is)."""
        p = self.positions
        if self._tick == p.tick and p.host_bound:
            n = min(p.idx, n)
        elif p.last_change is not None and p.last_change[0] == "trim":
            n = p.last_change[1]  # the first layer's (clamped) count
        self._change("trim", n)
        return n

    def size(self) -> int:
        return self.positions.idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.positions.ends

    @state.setter
    def state(self, v: tuple) -> None:
        self.keys, self.values, self.positions.ends = v

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in self.buffers)


class QuantizedRaggedKVCache(RaggedKVCache):
    """`RaggedKVCache` whose keys and values are stored quantized, in mlx-lm's `QuantizedKVCache` layout.

    Each token's key and value vectors are quantized on their own
    (`mx.quantize` along the head dimension, groups of `group_size`), so
    what a slot holds depends only on that token: rolling a stream back by
    any count, mid-way through an allocation step or not, leaves every kept
    slot as it was, and a verification's writes equal the one-token steps'.
    `keys` / `values` are (packed uint32, scales, biases) tuples; the
    attention layers see `bits` / `group_size` and read them through the
    quantized attention (mlx-lm's helper, or the fused CPU kernel when the
    mlx-lm ops are routed).

    Args:
        left_padding, positions: as `RaggedKVCache`.
        bits: 2, 3, 4, 5, 6 or 8 bits per stored value.
        group_size: 32, 64 or 128 values per scale and bias.
    """

    def __init__(
        self, left_padding: list[int], positions: RaggedPositions | None = None, bits: int = 8, group_size: int = 64
    ):
        super().__init__(left_padding, positions)
        self.bits, self.group_size = check_kv_quantization(bits, group_size)

    def _encode(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        D, Dv = keys.shape[-1], values.shape[-1]
        if D % self.group_size or Dv % self.group_size:
            raise ValueError(
                f"kv_group_size={self.group_size} does not divide the head dimensions (keys {D}, values {Dv})"
            )
        q = lambda a: tuple(mx.quantize(a, group_size=self.group_size, bits=self.bits))  # noqa: E731
        return q(keys), q(values)

    @property
    def buffers(self) -> list[mx.array] | None:
        return RaggedKVCache.buffers.fget(self)

    @buffers.setter
    def buffers(self, arrays: list[mx.array] | None) -> None:
        if arrays is None:
            self.keys = self.values = None
        else:
            self.keys, self.values = tuple(arrays[:3]), tuple(arrays[3:])

    def dense(self) -> tuple[mx.array, mx.array]:
        deq = lambda t: mx.dequantize(*t, group_size=self.group_size, bits=self.bits)  # noqa: E731
        return deq(self.keys), deq(self.values)


KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def check_kv_quantization(bits: object, group_size: object) -> tuple[int, int]:
    """(bits, group_size) checked: ValueError naming `kv_bits` / `kv_group_size` otherwise."""
    b = as_int("kv_bits", bits)
    g = as_int("kv_group_size", group_size)
    if b not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS} (or None for float KV), got {b}")
    if g not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {g}")
    return b, g


__all__ = ["KV_BITS", "KV_GROUP_SIZES", "QuantizedRaggedKVCache", "RaggedKVCache", "RaggedPositions", "check_kv_quantization"]
