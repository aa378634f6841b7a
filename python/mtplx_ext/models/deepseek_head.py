"""DeepSeek-V3 / GLM-4.5 MTP head layout.

Checkpoint keys, with N = num_hidden_layers (the layer after the trunk)::

    model.layers.N.enorm.weight              RMSNorm on embed(token t+1)
    model.layers.N.hnorm.weight              RMSNorm on the trunk hidden state at t
    model.layers.N.eh_proj.weight            [H, 2H] on concat[enorm(e), hnorm(h)]
    model.layers.N.{self_attn,mlp,...}.*     the decoder block, a trunk-family layer
    model.layers.N.shared_head.norm.weight   final RMSNorm
    model.layers.N.shared_head.head.weight   output projection [V, H]

`model.layers.N.embed_tokens` (a copy of the trunk's embedding in DeepSeek
checkpoints) is not kept: the head embeds with the trunk's table.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mtplx_ext.models import trunk as trunk_lib
from mtplx_ext.models.base import FlatBlockHead, HeadArgs

LAYOUT = "deepseek"
DEFAULT_HIDDEN_SOURCE = "post_norm"


def prefix_for(config: dict) -> str:
    """Checkpoint prefix of the head: the layer index after the trunk's last."""
    return f"model.layers.{int(config['num_hidden_layers'])}."


@dataclass
class ModelArgs(HeadArgs):
    vocab_size: int = 0
    num_hidden_layers: int = 0

    @classmethod
    def from_config(cls, config: dict, default_source: str = DEFAULT_HIDDEN_SOURCE) -> "ModelArgs":
        base = HeadArgs.from_config(config, default_source)
        return cls(
            **vars(base),
            vocab_size=int(config["vocab_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
        )


def layer_prefix(config: dict, i: int) -> str:
    """Checkpoint prefix of MTP module i: the i-th layer after the trunk's last."""
    return f"model.layers.{int(config['num_hidden_layers']) + i}."


def is_head_key(config: dict, key: str) -> bool:
    """Whether a checkpoint key is an MTP module's: module i is layer num_hidden_layers + i."""
    parts = key.split(".")
    return (
        key.startswith("model.layers.") and len(parts) > 2 and parts[2].isdigit()
        and int(parts[2]) >= int(config["num_hidden_layers"])
    )


def detect(weights: dict, config: dict) -> bool:
    """Whether a checkpoint holds weights of this layout."""
    if "num_hidden_layers" not in config:
        return False
    return f"{prefix_for(config)}eh_proj.weight" in weights


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class Model(FlatBlockHead):
    layout = LAYOUT
    own_modules = ("enorm", "hnorm", "eh_proj", "shared_head")
    ignored_modules = ("embed_tokens",)
    fusion_module = "eh_proj"  # the [H, 2H] projection of the concatenation

    def __init__(self, args: ModelArgs, trunk: nn.Module, module: int = 0, first: nn.Module | None = None):
        # Module i (its own norms, projection, block and shared head) is the
        # i-th layer after the trunk's last.
        super().__init__(args, trunk, prefix=f"model.layers.{args.num_hidden_layers + module}.", module=module)
        h = args.hidden_size
        self.enorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = trunk_lib.make_attention_layer(trunk)
        self.shared_head = SharedHead(h, args.vocab_size, args.rms_norm_eps)

    def combine(self, hidden: mx.array, embeds: mx.array) -> mx.array:
        return self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))

    def final_norm(self, x: mx.array) -> mx.array:
        return self.shared_head.norm(x)

    def logits(self, x: mx.array, trunk: nn.Module) -> mx.array:
        return self.shared_head.head(x)
