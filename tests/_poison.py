"""Fills MLX's buffer cache with junk so a kernel's fresh output is dirty."""

from __future__ import annotations

import mlx.core as mx

POISON_INT32 = 0x5A5A5A5A


def poison_allocator(nbytes: int, copies: int = 4) -> None:
    """Frees junk-filled buffers of `nbytes`, which MLX's allocator reuses.

    A kernel that forgets to write part of its output then leaves junk there
    instead of the zeros a fresh page would hold.
    """
    n = max(1, (nbytes + 3) // 4)
    junk = [mx.full((n,), POISON_INT32, dtype=mx.int32) for _ in range(copies)]
    mx.eval(junk)
    del junk
