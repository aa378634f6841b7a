"""Gemma 4 trunks (mlx-lm's `gemma4_text`): the layer loop, caches and KV sources.

Gemma 4's decoder differs from the families `trunk.trunk_hidden` loops over:
its layers take per-layer inputs (E2B / E4B), return their K/V so that the
last `num_kv_shared_layers` layers reuse the K/V of the last earlier layer
of their type (sliding or full attention), sliding layers attend over a
window, embeddings are scaled by sqrt(hidden) and logits are soft-capped.
This module re-runs mlx-lm's own loop (same modules, same order) so the
hidden state before the final norm is available, and names the layers
whose K/V an assistant drafter reads ("frozen KV": the last layer of each
type that stores K/V).

Caches exist for the K/V-storing layers only (mlx-lm's `make_cache` does the
same); shared layers get None and read their source layer's K/V.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtplx_ext.models import mlx_lm_internals

#: mlx-lm families handled here.
FAMILIES = ("gemma4_text",)


def is_gemma4(trunk: nn.Module) -> bool:
    """Whether a trunk is mlx-lm's `gemma4_text` model."""
    return type(trunk).__module__.rsplit(".", 1)[-1] in FAMILIES


def kv_layer_count(trunk: nn.Module) -> int:
    """Layers that store their own K/V (the first N - num_kv_shared_layers)."""
    args = trunk.args
    shared = int(args.num_kv_shared_layers or 0)
    return args.num_hidden_layers - shared if 0 < shared < args.num_hidden_layers else args.num_hidden_layers


def layer_types(trunk: nn.Module) -> list[str]:
    return list(trunk.args.layer_types)


def kv_sources(trunk: nn.Module) -> dict[str, int]:
    """Layer type -> index of the last K/V-storing layer of that type.

    These are the layers whose K/V the shared layers reuse, and the ones a
    Gemma 4 assistant attends over (transformers stores exactly these as
    `shared_kv_states`).
    """
    types = layer_types(trunk)
    out: dict[str, int] = {}
    for i in range(kv_layer_count(trunk)):
        out[types[i]] = i
    return out


def kv_shape(trunk: nn.Module, layer_type: str) -> tuple[int, int]:
    """(K/V heads, head dim) of the trunk's K/V for a layer type."""
    attn = trunk.model.layers[kv_sources(trunk)[layer_type]].self_attn
    return attn.n_kv_heads, attn.head_dim


def hidden(trunk: nn.Module, tokens: mx.array, cache: list | None, embeds: mx.array) -> mx.array:
    """mlx-lm's `Gemma4TextModel` loop without the final norm.

    Args:
        trunk: a `gemma4_text` `Model`.
        tokens: [B, T] ids in the vocabulary (per-layer embeddings read them).
        cache: one cache per K/V-storing layer (`kv_layer_count`), or None.
        embeds: [B, T, H] unscaled embeddings of `tokens`.

    Returns:
        [B, T, H] hidden states before `model.norm`.
    """
    return hidden_and_kv(trunk, tokens, cache, embeds)[0]


def hidden_and_kv(
    trunk: nn.Module, tokens: mx.array, cache: list | None, embeds: mx.array
) -> tuple[mx.array, list[tuple[Any, Any]]]:
    """`hidden`, plus each layer's (K/V, RoPE offset) as the layer returned them (shared layers: their source's).

    Training an assistant reads the source layers' K/V of a whole window from here.
    """
    inner = trunk.model
    layers = inner.layers
    h = embeds * inner.embed_scale
    per_layer: list[Any] = [None] * len(layers)
    if inner.hidden_size_per_layer_input:
        # Clipped ids: an out-of-vocabulary id already poisons its row through `embeds`.
        ids = mx.clip(tokens, 0, inner.vocab_size - 1)
        pli = mlx_lm_internals.gemma4_per_layer_inputs(inner, h, ids)
        per_layer = [pli[:, :, i, :] for i in range(len(layers))]
    caches = [None] * len(layers) if cache is None else list(cache) + [None] * (len(layers) - len(cache))
    masks = mlx_lm_internals.gemma4_masks(inner, h, caches)
    inter: list[tuple[Any, Any]] = [(None, None)] * len(layers)
    for i, (layer, c, mask, src, pl) in enumerate(zip(layers, caches, masks, inner.previous_kvs, per_layer)):
        kvs, offset = inter[src]
        h, kvs, offset = layer(h, mask, c, per_layer_input=pl, shared_kv=kvs, offset=offset)
        inter[i] = (kvs, offset)
    return h, inter


def softcap(trunk: nn.Module, logits: mx.array) -> mx.array:
    """The final logit soft-capping of the config (none when unset)."""
    cap = getattr(trunk.args, "final_logit_softcapping", None)
    if not cap:
        return logits
    return mx.tanh(logits / cap) * cap


def scaled_embed(trunk: nn.Module, embeds: mx.array) -> mx.array:
    """Gemma's input embedding: the table row times sqrt(hidden), in the table's dtype."""
    return embeds * mx.array(trunk.model.embed_scale, dtype=embeds.dtype)


__all__ = ["FAMILIES", "hidden", "hidden_and_kv", "is_gemma4", "kv_layer_count", "kv_shape", "kv_sources", "scaled_embed", "softcap"]
