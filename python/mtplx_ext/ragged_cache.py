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
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


class RaggedKVCache(_BaseCache):
    """Batch KV cache with a device-side end slot per stream.

    Drop-in for `BatchKVCache` in mlx-lm attention layers: `offset` (the
    RoPE position of the next token, per stream), `update_and_fetch` and
    `make_mask` (always an array mask [B, 1, N, S]).

    Args:
        left_padding: per-stream count of pad tokens on the left of the
            prompts (its length is the batch size).
    """

    step = 256

    def __init__(self, left_padding: list[int]):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        self.ends = mx.zeros((len(left_padding),), dtype=mx.int32)
        self._idx = 0
        # True once streams may end at different slots (a rollback happened):
        # writes then scatter per stream instead of one slice update.
        self._ragged = False

    @property
    def offset(self) -> mx.array:
        """[B] RoPE position of each stream's next token."""
        return self.ends - self.left_padding

    def _reserve(self, n: int, like_k: mx.array, like_v: mx.array) -> None:
        need = self._idx + n
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        B, H, _, Dk = like_k.shape
        Dv = like_v.shape[3]
        grow = ((need - (0 if self.keys is None else self.keys.shape[2]) + self.step - 1) // self.step) * self.step
        new_k = mx.zeros((B, H, grow, Dk), like_k.dtype)
        new_v = mx.zeros((B, H, grow, Dv), like_v.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Writes [B, H, T, D] keys/values at each stream's end; returns the visible slots."""
        T = keys.shape[2]
        self._reserve(T, keys, values)
        if self._ragged:
            idx = (self.ends[:, None] + mx.arange(T, dtype=mx.int32))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(idx, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(idx, values.shape), values, axis=2)
        else:
            self.keys[..., self._idx : self._idx + T, :] = keys
            self.values[..., self._idx : self._idx + T, :] = values
        self.ends = self.ends + T
        self._idx += T
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs: Any) -> mx.array:
        """[B, 1, N, size() + N] bool: query t of stream b sees its slots up to ends[b] + t."""
        if window_size is not None:
            raise NotImplementedError("RaggedKVCache does not support sliding-window attention")
        slots = mx.arange(self._idx + N, dtype=mx.int32)
        query_slots = self.ends[:, None] + mx.arange(N, dtype=mx.int32)
        mask = (slots[None, None, :] <= query_slots[:, :, None]) & (
            slots[None, None, :] >= self.left_padding[:, None, None]
        )
        return mask[:, None]

    def rollback(self, counts: mx.array) -> None:
        """Drops the last counts[b] tokens of each stream b ([B] int, on the device)."""
        self.ends = self.ends - counts.astype(mx.int32)
        self._ragged = True

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drops the last `n` tokens of every stream."""
        n = min(self._idx, n)
        self._idx -= n
        self.ends = self.ends - n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.ends, self.left_padding

    @state.setter
    def state(self, v: tuple) -> None:
        self.keys, self.values, self.ends, self.left_padding = v

    @property
    def meta_state(self) -> tuple:
        return (str(self._idx), str(int(self._ragged)))

    @meta_state.setter
    def meta_state(self, v: tuple) -> None:
        self._idx, self._ragged = int(v[0]), bool(int(v[1]))

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


__all__ = ["RaggedKVCache"]
