"""The one place that reads mlx-lm's private attributes, each with why no public one does.

mlx-lm keeps a few things the package needs behind underscore names; when
mlx-lm renames one, this module is where it breaks, and the pinned mlx-lm
version's tests (tests/models, tests/decode against mlx-lm) say so.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def batch_cache_end(cache: Any) -> int:
    """The end slot of mlx-lm's `BatchKVCache` (every stream ends there).

    Why private: the cache exposes no public length; `offset` is per stream
    and counts padding differently.
    """
    return int(cache._idx)


def gemma4_per_layer_inputs(inner: Any, h: mx.array, ids: mx.array) -> mx.array:
    """Gemma 4's per-layer inputs for embeddings `h` of token `ids`, as its text model computes them.

    Why private: the trunk's forward is re-run layer by layer (to keep each
    layer's KV for the assistant), and mlx-lm builds these inputs only inside
    its own `__call__`.
    """
    return inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(ids))


def gemma4_masks(inner: Any, h: mx.array, caches: list[Any]) -> list[Any]:
    """Gemma 4's per-layer attention masks (sliding and global) for `h` over `caches`.

    Why private: as `gemma4_per_layer_inputs`, built only inside mlx-lm's `__call__`.
    """
    return inner._make_masks(h, caches)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper` (the object itself otherwise).

    Why private: the grammar engine needs the HF tokenizer's vocabulary and
    decoder; the wrapper forwards attributes but not its type.
    """
    return getattr(tokenizer, "_tokenizer", tokenizer)


__all__ = ["batch_cache_end", "gemma4_masks", "gemma4_per_layer_inputs", "hf_tokenizer"]
