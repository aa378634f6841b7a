"""Qwen3-Next / Qwen3.5 MTP head layout.

Checkpoint keys::

    mtp.pre_fc_norm_embedding.weight   RMSNorm on embed(token t+1)
    mtp.pre_fc_norm_hidden.weight      RMSNorm on the trunk hidden state at t
    mtp.fc.weight                      [H, 2H] on concat[norm_e(e), norm_h(h)]
    mtp.layers.0.*                     one full-attention decoder layer
    mtp.norm.weight                    final RMSNorm

Embedding and lm_head are shared with the trunk. These checkpoints store
every RMSNorm weight of the head zero-centred (the norm scales by 1 + w).
The head keeps them so (`ZeroCentredRMSNorm` adds the 1 when it runs), which
computes what mlx-lm's +1-on-load computes while keeping load and save
bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mtplx_ext.models import trunk as trunk_lib
from mtplx_ext.models.base import HeadArgs, MTPHead, stack_experts

LAYOUT = "qwen3_next"
PREFIX = "mtp."
DEFAULT_HIDDEN_SOURCE = "post_norm"


@dataclass
class ModelArgs(HeadArgs):
    num_experts: int = 0

    @classmethod
    def from_config(cls, config: dict, default_source: str = DEFAULT_HIDDEN_SOURCE) -> "ModelArgs":
        base = HeadArgs.from_config(config, default_source)
        text = trunk_lib.text_config(config)
        return cls(**vars(base), num_experts=int(text.get("num_experts", 0) or 0))


def layer_prefix(config: dict, i: int) -> str:
    """Checkpoint prefix of MTP layer i (the head uses layer 0)."""
    return f"{PREFIX}layers.{i}."


def detect(weights: dict, config: dict) -> bool:
    """Whether a checkpoint holds weights of this layout."""
    return any(k.startswith(PREFIX) for k in weights)


class Model(MTPHead):
    layout = LAYOUT
    prefix = PREFIX
    fusion_module = "fc"  # the [H, 2H] projection of the concatenation

    def __init__(self, args: ModelArgs, trunk: nn.Module):
        super().__init__(args, trunk)
        h = args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = [trunk_lib.make_attention_layer(trunk)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.use_zero_centred_norms()

    def combine(self, hidden: mx.array, embeds: mx.array) -> mx.array:
        e = self.pre_fc_norm_embedding(embeds)
        h = self.pre_fc_norm_hidden(hidden)
        return self.fc(mx.concatenate([e, h], axis=-1))

    def final_norm(self, x: mx.array) -> mx.array:
        return self.norm(x)

    def layer_list(self) -> list[nn.Module]:
        return self.layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF keys (per-expert MoE weights included) -> module names."""
        weights = dict(weights)
        stack_experts(weights, f"{PREFIX}layers.0.mlp", self.args.num_experts)
        return super().sanitize(weights)
