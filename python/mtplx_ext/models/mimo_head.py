"""MiMo MTP head layout.

Checkpoint keys::

    model.mtp_layers.0.token_layernorm.weight    RMSNorm on embed(token t+1)
    model.mtp_layers.0.hidden_layernorm.weight   RMSNorm on the trunk hidden state at t
    model.mtp_layers.0.input_proj.weight         [H, 2H] on concat[hidden, token]
    model.mtp_layers.0.{self_attn,mlp,...}.*     the decoder layer
    model.mtp_layers.0.final_layernorm.weight    final RMSNorm

Note the concatenation order: hidden first, then the token embedding. The
embedding and lm_head are the trunk's. MiMo feeds the head the trunk hidden
state before the final norm by default. A checkpoint with several MTP
layers stores layer i under `model.mtp_layers.{i}.`, all of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mtplx_ext.models import trunk as trunk_lib
from mtplx_ext.models.base import FlatBlockHead, HeadArgs

LAYOUT = "mimo"
PREFIX = "model.mtp_layers.0."
DEFAULT_HIDDEN_SOURCE = "pre_norm"


@dataclass
class ModelArgs(HeadArgs):
    @classmethod
    def from_config(cls, config: dict, default_source: str = DEFAULT_HIDDEN_SOURCE) -> "ModelArgs":
        return cls(**vars(HeadArgs.from_config(config, default_source)))


def layer_prefix(config: dict, i: int) -> str:
    """Checkpoint prefix of MTP layer i."""
    return f"model.mtp_layers.{i}."


def is_head_key(config: dict, key: str) -> bool:
    """Whether a checkpoint key is an MTP module's."""
    return key.startswith("model.mtp_layers.")


def detect(weights: dict, config: dict) -> bool:
    """Whether a checkpoint holds weights of this layout."""
    return f"{PREFIX}input_proj.weight" in weights


class Model(FlatBlockHead):
    layout = LAYOUT
    own_modules = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
    fusion_module = "input_proj"  # the [H, 2H] projection of the concatenation

    def __init__(self, args: ModelArgs, trunk: nn.Module, module: int = 0, first: nn.Module | None = None):
        super().__init__(args, trunk, prefix=layer_prefix({}, module), module=module)
        h = args.hidden_size
        self.token_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.hidden_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.block = trunk_lib.make_attention_layer(trunk)
        self.final_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def combine(self, hidden: mx.array, embeds: mx.array) -> mx.array:
        h = self.hidden_layernorm(hidden)
        e = self.token_layernorm(embeds)
        return self.input_proj(mx.concatenate([h, e], axis=-1))

    def final_norm(self, x: mx.array) -> mx.array:
        return self.final_layernorm(x)
