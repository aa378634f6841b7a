"""Qwen3-Next / Qwen3.5 MTP head layout.

Checkpoint keys::

    mtp.pre_fc_norm_embedding.weight   RMSNorm on embed(token t+1)
    mtp.pre_fc_norm_hidden.weight      RMSNorm on the trunk hidden state at t
    mtp.fc.weight                      [H, 2H] on concat[norm_e(e), norm_h(h)]
    mtp.layers.0.*                     one full-attention decoder layer
    mtp.norm.weight                    final RMSNorm

With several MTP layers (`mtp.layers.{i}.*`), module i is layer i inside the
first module's combination and final norm (as vLLM's Qwen3-Next MTP applies
layer i for draft step i); module i > 0 holds only its layer.

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
    """Checkpoint prefix of MTP layer i."""
    return f"{PREFIX}layers.{i}."


def is_head_key(config: dict, key: str) -> bool:
    """Whether a checkpoint key is an MTP module's."""
    return key.startswith(PREFIX)


def detect(weights: dict, config: dict) -> bool:
    """Whether a checkpoint holds weights of this layout."""
    return any(k.startswith(PREFIX) for k in weights)


class Model(MTPHead):
    layout = LAYOUT
    prefix = PREFIX
    fusion_module = "fc"  # the [H, 2H] projection of the concatenation

    def __init__(self, args: ModelArgs, trunk: nn.Module, module: int = 0, first: "Model | None" = None):
        super().__init__(args, trunk, module)
        h = args.hidden_size
        if module == 0:
            self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
            self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        elif first is None:
            raise ValueError("a later qwen3_next MTP module needs the first one (its combination and norm are shared)")
        # Module i > 0 owns only its layer and uses the first module's
        # combination and final norm (a plain attribute: not its parameters).
        object.__setattr__(self, "_shared", self if module == 0 else first)
        self.layers = [trunk_lib.make_attention_layer(trunk)]
        self.use_zero_centred_norms()

    def combine(self, hidden: mx.array, embeds: mx.array) -> mx.array:
        m = self._shared
        e = m.pre_fc_norm_embedding(embeds)
        h = m.pre_fc_norm_hidden(hidden)
        return m.fc(mx.concatenate([e, h], axis=-1))

    def final_norm(self, x: mx.array) -> mx.array:
        return self._shared.norm(x)

    def layer_list(self) -> list[nn.Module]:
        return self.layers

    def owns(self, key: str) -> bool:
        # Its own layer; the first module also the shared tensors.
        if key.startswith(f"{PREFIX}layers."):
            return key.startswith(self._own_layer)
        return key.startswith(PREFIX) and self.module_index == 0

    @property
    def _own_layer(self) -> str:
        return layer_prefix({}, self.module_index)

    def to_checkpoint_name(self, name: str) -> str:
        if name.startswith("layers.0."):
            name = self._own_layer[len(PREFIX):] + name[len("layers.0."):]
        return PREFIX + name

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF keys (per-expert MoE weights included) -> module names."""
        layer0 = layer_prefix({}, 0)
        weights = {
            layer0 + k[len(self._own_layer):] if k.startswith(self._own_layer) else k: v
            for k, v in weights.items()
            if self.owns(k)
        }
        stack_experts(weights, f"{layer0}mlp", self.args.num_experts)
        return super().sanitize(weights)
