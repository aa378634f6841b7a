"""Random ragged prompt batches for cache tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import _seed


def fresh_seed() -> int:
    """A new random seed for a test model."""
    return _seed.fresh()


def ragged_batch(rng: np.random.Generator, vocab: int, B: int) -> tuple[mx.array, list[int]]:
    """[B, width] left-padded random tokens and each row's pad count (1-8 tokens per row)."""
    lengths = rng.integers(1, 9, size=B)
    width = int(lengths.max())
    pads = [width - int(n) for n in lengths]
    return mx.array(rng.integers(0, vocab, size=(B, width)).astype(np.int32)), pads
