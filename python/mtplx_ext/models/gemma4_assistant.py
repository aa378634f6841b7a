"""Gemma 4 assistant drafters (`gemma4_assistant`): MTP that reads the target's KV ("frozen KV").

Google's Gemma 4 assistant checkpoints are small decoders without K/V
projections: every layer is KV-shared with the *target*. One draft step
(transformers' `Gemma4AssistantForCausalLM` under its single-position
candidate generator):

    x   = pre_projection(concat(target_embed(tok) * sqrt(H_target), h))   # h: [B, 1, H_target]
    x   = layers(x): queries at a fixed position p (the last verified
          token's) attend over the target's stored K/V of its last
          K/V-storing layer of the layer's type, positions < p (sliding
          layers: the last `sliding_window` + 1 of them, as transformers masks)
    n   = norm(x);  logits = tied embedding(n) (or the centroid head);  h' = post_projection(n)

The first step of a cycle starts from the target's final-normed hidden
state at the position before x0 and x0's embedding; step i + 1 from h' and
draft i, at the same position over the same K/V. The assistant keeps no
cache of its own, so after a verification nothing but the target's KV (which
already rolls back per stream) has to follow the commit.

E2B / E4B assistants (`use_ordered_embeddings`) project onto the vocabulary
through a centroid head: the top `centroid_intermediate_top_k` of
`num_centroids` centroid logits select as many vocabulary blocks
(`token_ordering`), whose tokens get their embedding logits; every other
token gets the row's smallest selected logit minus one (transformers takes
that minimum over the whole batch; here it is per row, so a row's draft
distribution does not depend on its neighbours).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from mtplx_ext.models import gemma4_trunk, mlx_lm_internals

LAYOUT = "gemma4_assistant"
DEFAULT_HIDDEN_SOURCE = "post_norm"


@dataclass
class AssistantArgs:
    """The assistant's settings (config.json of a `gemma4_assistant` folder)."""

    text: gemma4_text.ModelArgs
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True
    #: The target hidden state the assistant reads: after the final norm.
    hidden_source: str = DEFAULT_HIDDEN_SOURCE

    @classmethod
    def from_config(cls, config: dict) -> "AssistantArgs":
        text = dict(config["text_config"])
        text.setdefault("model_type", "gemma4_text")
        # Every assistant layer is KV-shared (transformers sets the same).
        text["num_kv_shared_layers"] = int(text["num_hidden_layers"])
        text.setdefault("hidden_size_per_layer_input", 0)
        text.setdefault("use_double_wide_mlp", False)
        return cls(
            text=gemma4_text.ModelArgs.from_dict(text),
            backbone_hidden_size=int(config["backbone_hidden_size"]),
            use_ordered_embeddings=bool(config.get("use_ordered_embeddings", False)),
            num_centroids=int(config.get("num_centroids", 2048)),
            centroid_intermediate_top_k=int(config.get("centroid_intermediate_top_k", 32)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )


class _Decoder(nn.Module):
    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class MaskedEmbedding(nn.Module):
    """The centroid head of E2B / E4B assistants (see the module docstring)."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        t = args.text
        self.top_k = args.centroid_intermediate_top_k
        self.num_centroids = args.num_centroids
        self.vocab_size = t.vocab_size
        self.centroids = nn.Linear(t.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.arange(t.vocab_size, dtype=mx.int32)

    def __call__(self, x: mx.array, embed: nn.Module) -> mx.array:
        B, T, _ = x.shape
        scores = self.centroids(x)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        blocks = self.token_ordering.astype(mx.int32).reshape(self.num_centroids, -1)
        ids = blocks[top].reshape(B, T, -1)  # [B, T, top_k * V / C]
        rows = embed(ids)  # dequantized rows of the (tied) output table
        sel = (rows @ x[..., :, None])[..., 0]
        fill = sel.min(axis=-1, keepdims=True) - 1.0
        out = mx.broadcast_to(fill, (B, T, self.vocab_size))
        return mx.put_along_axis(out, ids, sel, axis=-1)


class Gemma4Assistant(nn.Module):
    """The assistant's weights under their checkpoint names, and one draft step."""

    layout = LAYOUT
    #: No cache of its own: it reads the target's (`MTPRuntime.make_head_cache` gives []).
    frozen_kv = True

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args = args
        t = args.text
        self.model = _Decoder(t)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, t.hidden_size, bias=False)
        self.post_projection = nn.Linear(t.hidden_size, args.backbone_hidden_size, bias=False)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(args)

    @property
    def layer_types(self) -> list[str]:
        return [l.layer_type for l in self.model.layers]

    def layer_list(self) -> list[nn.Module]:
        return list(self.model.layers)

    def logits(self, normed: mx.array) -> mx.array:
        if self.args.use_ordered_embeddings:
            return self.masked_embedding(normed, self.model.embed_tokens)
        if not self.args.tie_word_embeddings:
            return self.lm_head(normed)
        return self.model.embed_tokens.as_linear(normed)

    def step(
        self, embeds: mx.array, hidden: mx.array, frozen: "FrozenKV"
    ) -> tuple[mx.array, mx.array]:
        """One draft step.

        Args:
            embeds: [B, 1, H_target] scaled target embeddings of the last token.
            hidden: [B, 1, H_target] target hidden state (or the previous step's).
            frozen: the target's K/V, masks and query positions (`frozen_kv`).

        Returns:
            ([B, 1, V] logits of the next token, [B, 1, H_target] state for the next step).
        """
        x = self.pre_projection(mx.concatenate([embeds, hidden], axis=-1))
        for layer in self.model.layers:
            kind = layer.layer_type
            x, _, _ = layer(x, frozen.masks[kind], None, shared_kv=frozen.kv[kind], offset=frozen.offset)
        normed = self.model.norm(x)
        return self.logits(normed), self.post_projection(normed)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint tensors -> this module's names (the tied `lm_head` copy is dropped)."""
        out = {}
        for k, v in weights.items():
            if k == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if "rotary_emb" in k:
                continue
            if k.endswith("token_ordering"):
                v = v.astype(mx.int32)
            out[k] = v
        return out


@dataclass
class FrozenKV:
    """What every draft step of a cycle reads from the target.

    Attributes:
        kv: layer type -> (keys, values) [B, H_kv, S, D] of the target's source layer.
        masks: layer type -> [B, 1, 1, S] bool, the slots a query sees.
        offset: [B] RoPE position of the queries (x0's position).
    """

    kv: dict[str, tuple[mx.array, mx.array]]
    masks: dict[str, mx.array]
    offset: mx.array


def _slots(c: Any) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(keys, values, [B] end slots, [B] left padding) of a RaggedKVCache or BatchKVCache."""
    if hasattr(c, "positions"):  # RaggedKVCache (dequantized when it stores quantized KV)
        p = c.positions
        S = p.capacity if p.capacity is not None else p.idx
        keys, values = c.dense()
        return keys[..., :S, :], values[..., :S, :], p.ends, p.left_padding
    S = mlx_lm_internals.batch_cache_end(c)  # every stream of a BatchKVCache ends at the same slot
    pads = c.left_padding
    return c.keys[..., :S, :], c.values[..., :S, :], mx.full(pads.shape, S, mx.int32), pads


def visible_keys(slots: mx.array, ends: mx.array, kind: str, window: int) -> mx.array:
    """Which key slots a draft query sees: those before `ends` (the query's own slot is not
    stored yet), and for sliding layers only the last `window + 1` of them, as transformers'
    flipped bidirectional window mask does (|q - kv| <= window, q one past the last key)."""
    m = slots < ends
    return m & (slots >= ends - (window + 1)) if kind == "sliding_attention" else m


def frozen_kv(trunk: nn.Module, cache: list, types: list[str], window: int) -> FrozenKV:
    """The target's K/V an assistant attends over, from the trunk's caches after a commit.

    Slots [left_padding, end) of a stream hold its positions 0 .. p - 1 (p is
    x0's position: x0 is not forwarded yet); sliding layers see the last
    `window + 1` of them, as transformers' flipped bidirectional window mask
    does (|q - kv| <= window, q one past the last key).
    """
    sources = gemma4_trunk.kv_sources(trunk)
    kv, masks, offset = {}, {}, None
    for kind in dict.fromkeys(types):
        keys, values, ends, pads = _slots(cache[sources[kind]])
        s = mx.arange(keys.shape[2], dtype=mx.int32)[None]
        m = (s >= pads[:, None]) & visible_keys(s, ends[:, None], kind, window)
        kv[kind] = (keys, values)
        masks[kind] = m[:, None, None, :]
        offset = (ends - pads).astype(mx.int32)
    return FrozenKV(kv, masks, offset)


__all__ = ["AssistantArgs", "FrozenKV", "Gemma4Assistant", "LAYOUT", "MaskedEmbedding", "frozen_kv", "visible_keys"]
