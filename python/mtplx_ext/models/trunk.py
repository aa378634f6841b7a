"""Trunk helpers: mlx-lm model classes, hidden states, caches, head layers.

The trunk is always mlx-lm's own `Model` of its family; these functions
only re-run its layer loop so the hidden state before the final norm is
available to MTP heads that consume it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache
from mlx_lm.utils import MODEL_REMAPPING

from mtplx_ext.cache.ragged import QuantizedRaggedKVCache, RaggedKVCache, RaggedPositions
from mtplx_ext.models import gemma4_trunk

# Families whose attention applies the mask with mx.where and so needs an
# array mask, never the "causal" string.
_ARRAY_MASK_FAMILIES = frozenset({"deepseek_v3"})


def trunk_module(model_type: str) -> ModuleType:
    """Imports the mlx-lm module of a model family.

    Args:
        model_type: the config's `model_type`, e.g. "qwen3".

    Returns:
        The `mlx_lm.models.<family>` module (with `Model` and `ModelArgs`).

    Raises:
        ValueError: if mlx-lm has no such family.
    """
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty string, got {model_type!r}")
    name = MODEL_REMAPPING.get(model_type, model_type)
    if not name.replace("_", "").isalnum():
        raise ValueError(f"unknown model_type {model_type!r}")
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    except ImportError as e:
        raise ValueError(f"unknown model_type {model_type!r}: mlx-lm has no such family") from e


def family_of(trunk: nn.Module) -> str:
    """The mlx-lm family name of a trunk model (its module's short name)."""
    return type(trunk).__module__.rsplit(".", 1)[-1]


def uses_array_mask(trunk: nn.Module) -> bool:
    """Whether the family's attention needs an array mask."""
    return family_of(trunk) in _ARRAY_MASK_FAMILIES


def is_recurrent(layer: nn.Module) -> bool:
    """Whether a trunk layer keeps recurrent (non-trimmable) state."""
    return bool(getattr(layer, "is_linear", False))


def safe_embed(trunk: nn.Module, tokens: mx.array, vocab_size: int) -> mx.array:
    """Embeds tokens; an out-of-vocabulary id gives a NaN row, never a crash.

    MLX's gather has no bounds check (an id past the table can crash the
    process), so ids are clipped for the gather and their rows poisoned with
    NaN: the logits of that stream become NaN, which `verify_greedy` reports
    as a bad row, instead of silently reading another token's embedding.
    """
    valid = (tokens >= 0) & (tokens < vocab_size)
    e = trunk.model.embed_tokens(mx.clip(tokens, 0, vocab_size - 1))
    return mx.where(valid[..., None], e, mx.array(float("nan"), dtype=e.dtype))


def trunk_hidden(
    trunk: nn.Module,
    tokens: mx.array,
    cache: list | None = None,
    embeds: mx.array | None = None,
) -> mx.array:
    """Runs the trunk's layers and returns the hidden state before the final norm.

    Mirrors the layer loop of mlx-lm's inner models (attention mask from the
    first attention layer's cache, SSM mask from the first recurrent one), so
    `final_norm` of the result equals what the family's `model(...)` returns.

    Args:
        trunk: an mlx-lm `Model`.
        tokens: [B, T] token ids.
        cache: one cache per layer, or None.
        embeds: [B, T, H] embeddings of `tokens` to use instead of the table.

    Returns:
        [B, T, H] hidden states.
    """
    inner = trunk.model
    h = inner.embed_tokens(tokens) if embeds is None else embeds
    if gemma4_trunk.is_gemma4(trunk):
        return gemma4_trunk.hidden(trunk, tokens, cache, h)
    layers = local_layers(trunk)
    if cache is None:
        cache = [None] * len(layers)
    attn_idx = next((i for i, l in enumerate(layers) if not is_recurrent(l)), None)
    ssm_idx = next((i for i, l in enumerate(layers) if is_recurrent(l)), None)
    fa_mask = ssm_mask = None
    if attn_idx is not None:
        fa_mask = create_attention_mask(h, cache[attn_idx], return_array=uses_array_mask(trunk))
    if ssm_idx is not None:
        ssm_mask = create_ssm_mask(h, cache[ssm_idx])
    rank, size = pipeline_stage(trunk)
    if size > 1 and rank < size - 1:  # the stage after ours in the layer order runs first
        h = mx.distributed.recv_like(h, rank + 1)
    for layer, c in zip(layers, cache):
        h = layer(h, ssm_mask if is_recurrent(layer) else fa_mask, c)
    if size > 1:
        if rank != 0:
            h = mx.distributed.send(h, rank - 1)
        # Every stage gets the last stage's output (rank 0 holds the last layers).
        h = mx.distributed.all_gather(h)[: h.shape[0]]
    return h


def pipeline_stage(trunk: nn.Module) -> tuple[int, int]:
    """(rank, stages) of a trunk split by mlx-lm's `pipeline()`; (0, 1) when it is whole."""
    inner = trunk.model
    return int(getattr(inner, "pipeline_rank", 0)), int(getattr(inner, "pipeline_size", 1))


def local_layers(trunk: nn.Module) -> list[nn.Module]:
    """The trunk layers this process runs: all of them, or its pipeline stage's.

    mlx-lm's `pipeline()` keeps layer numbering by putting None in place of
    the layers of later ranks and cutting off those of earlier ones; the
    stage's own layers are `pipeline_layers`.
    """
    inner = trunk.model
    if pipeline_stage(trunk)[1] > 1:
        return list(inner.pipeline_layers)
    return list(inner.layers)


def final_norm(trunk: nn.Module, hidden: mx.array) -> mx.array:
    """Applies the trunk's final norm."""
    return trunk.model.norm(hidden)


def text_model(trunk: nn.Module) -> nn.Module:
    """The text model holding `args`, `model` and `lm_head`.

    Multimodal families (Qwen3.5) wrap it as `language_model`; for the
    others it is the trunk itself.
    """
    return trunk["language_model"] if "language_model" in trunk else trunk


def text_config(config: dict) -> dict:
    """A config's text fields, flattened out of `text_config` when nested."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def project(trunk: nn.Module, normed: mx.array) -> mx.array:
    """The trunk's output projection (lm_head, or the tied embedding)."""
    lm = text_model(trunk)
    if getattr(lm.args, "tie_word_embeddings", False) or "lm_head" not in lm:
        logits = trunk.model.embed_tokens.as_linear(normed)
    else:
        logits = lm.lm_head(normed)
    return gemma4_trunk.softcap(lm, logits) if gemma4_trunk.is_gemma4(lm) else logits


def make_trunk_cache(
    trunk: nn.Module,
    left_padding: list[int],
    ragged: bool = False,
    capacity: int | None = None,
    kv: tuple[int | None, int] = (None, 64),
) -> list[Any]:
    """Batch-aware caches, one per trunk layer (of this rank's layers), for left-padded prompts.

    Gemma 4: one per K/V-storing layer (its shared layers reuse those), and
    never rotating: sliding layers mask their window instead
    (`RaggedKVCache.make_mask`), so per-stream rollback stays exact.
    """
    layers = local_layers(trunk)
    if gemma4_trunk.is_gemma4(trunk):
        layers = layers[: gemma4_trunk.kv_layer_count(trunk)]
    return make_layer_caches(layers, left_padding, ragged, capacity, kv)


def make_layer_caches(
    layers: list[nn.Module],
    left_padding: list[int],
    ragged: bool = False,
    capacity: int | None = None,
    kv: tuple[int | None, int] = (None, 64),
) -> list[Any]:
    """`ArraysCache(2, left_padding)` for recurrent layers, else `BatchKVCache`
    (`RaggedKVCache` when `ragged`: per-stream rollback without a re-forward;
    with a fixed slot `capacity` when given). `kv` = (bits, group size) with
    bits not None: `QuantizedRaggedKVCache`, ragged whatever `ragged` says."""
    if capacity is not None and not ragged:
        raise ValueError("capacity is only supported with ragged=True")
    bits, group = kv
    ragged = ragged or bits is not None
    positions = RaggedPositions(list(left_padding), capacity) if ragged else None

    def attention_cache() -> Any:
        if bits is not None:
            return QuantizedRaggedKVCache(list(left_padding), positions, bits, group)
        return RaggedKVCache(list(left_padding), positions) if ragged else BatchKVCache(list(left_padding))

    return [ArraysCache(size=2, left_padding=list(left_padding)) if is_recurrent(l) else attention_cache() for l in layers]


def make_attention_layer(trunk: nn.Module) -> nn.Module:
    """A fresh full-attention decoder layer of the trunk's family, for a head.

    The layer is built like the trunk's own layers (same class and args), at
    an index that makes it a full-attention layer: for hybrid families the
    first attention layer's index, for DeepSeek the MTP layer's index (so it
    is a MoE layer when the trunk's later layers are).
    """
    args = text_model(trunk).args
    family = family_of(trunk)
    layers = trunk.model.layers
    if hasattr(args, "full_attention_interval"):
        # Hybrid families: a layer is linear unless (idx + 1) % interval == 0.
        return type(layers[0])(args, args.full_attention_interval - 1)
    if family in ("deepseek_v3", "glm4_moe"):
        return type(layers[0])(args, args.num_hidden_layers)
    idx = next((i for i, l in enumerate(layers) if not is_recurrent(l)), None)
    if idx is None:
        raise ValueError(f"trunk family {family!r} has no full-attention layer to copy")
    try:
        return type(layers[idx])(args)
    except TypeError:
        return type(layers[idx])(args, idx)
