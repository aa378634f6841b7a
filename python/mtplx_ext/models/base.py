"""Shared pieces of the MTP head layouts: args, the layer loop, weight maps."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.base import create_attention_mask

from mtplx_ext.models import trunk as trunk_lib

HIDDEN_SOURCES = ("pre_norm", "post_norm")


@dataclass
class HeadArgs:
    """Settings every head layout shares.

    Attributes:
        hidden_size: trunk hidden size H.
        rms_norm_eps: epsilon of the head's RMSNorms.
        hidden_source: "post_norm" if the head consumes the trunk's hidden
            state after its final norm, "pre_norm" if before it.
    """

    hidden_size: int
    rms_norm_eps: float
    hidden_source: str

    @classmethod
    def from_config(cls, config: dict, default_source: str) -> "HeadArgs":
        config = trunk_lib.text_config(config)
        source = config.get("mtp_hidden_source") or default_source
        if source not in HIDDEN_SOURCES:
            raise ValueError(
                f"config field mtp_hidden_source must be one of {HIDDEN_SOURCES}, got {source!r}"
            )
        return cls(
            hidden_size=int(config["hidden_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            hidden_source=source,
        )


class MTPHead(nn.Module):
    """Base of the head layouts: combine, one attention layer, final norm.

    Subclasses build their own submodules (named as in their checkpoints)
    and implement `combine`, `final_norm`, `layer_list` and `logits`.
    """

    layout: str = ""
    prefix: str = ""
    fusion_module: str = ""

    def __init__(self, args: HeadArgs, trunk: nn.Module, module: int = 0):
        super().__init__()
        self.args = args
        #: Which MTP module of the checkpoint this is (0: the first; module i
        #: drafts the (i + 1)-th token of a cycle).
        self.module_index = module
        self._array_mask = trunk_lib.uses_array_mask(trunk)

    def combine(self, hidden: mx.array, embeds: mx.array) -> mx.array:
        raise NotImplementedError

    def final_norm(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    def layer_list(self) -> list[nn.Module]:
        raise NotImplementedError

    def logits(self, x: mx.array, trunk: nn.Module) -> mx.array:
        """Output projection; by default the trunk's shared lm_head."""
        return trunk_lib.project(trunk, x)

    def states(self, hidden: mx.array, embeds: mx.array, cache: list | None = None) -> tuple[mx.array, mx.array]:
        """The head's hidden states before and after its final norm.

        Args:
            hidden: [B, T, H] trunk hidden states at positions t (or, for a
                chained draft step, the head's own output at the step before).
            embeds: [B, T, H] embeddings of the tokens at t + 1.
            cache: one cache per head layer, or None.

        Returns:
            ([B, T, H] pre-norm, [B, T, H] normed) states; the normed ones
            are the input of `logits`.
        """
        x = self.combine(hidden, embeds)
        layers = self.layer_list()
        if cache is None:
            cache = [None] * len(layers)
        mask = create_attention_mask(x, cache[0], return_array=self._array_mask)
        for layer, c in zip(layers, cache):
            x = layer(x, mask, c)
        return x, self.final_norm(x)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache: list | None = None) -> mx.array:
        """[B, T, H] normed head hidden states for the token after next (see `states`)."""
        return self.states(hidden, embeds, cache)[1]

    # -- checkpoint names ------------------------------------------------

    def use_zero_centred_norms(self) -> None:
        """Swaps every RMSNorm of the head for a `ZeroCentredRMSNorm`."""
        swaps = [
            (name, ZeroCentredRMSNorm(m.weight.shape[0], m.eps))
            for name, m in self.named_modules()
            if isinstance(m, nn.RMSNorm) and name
        ]
        self.update_modules(tree_unflatten(swaps))

    def to_checkpoint_name(self, name: str) -> str:
        """Checkpoint key of a module-relative parameter name."""
        return self.prefix + name

    def owns(self, key: str) -> bool:
        """Whether a checkpoint key is one of this module's tensors (`sanitize` takes exactly these)."""
        return key.startswith(self.prefix)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint head weights -> module-relative names.

        Args:
            weights: the head's checkpoint entries (full checkpoint keys).

        Returns:
            Weights to load with `load_weights`.
        """
        return {k[len(self.prefix):]: v for k, v in weights.items() if k.startswith(self.prefix)}

    def checkpoint_weights(self) -> dict[str, mx.array]:
        """The head's parameters under checkpoint names, as stored on disk."""
        return {self.to_checkpoint_name(k): v for k, v in tree_flatten(self.parameters())}


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm whose weight w is stored zero-centred: it scales by 1 + w.

    Qwen3-Next checkpoints store norm weights this way. Holding w itself
    (rather than adding 1 on load, as mlx-lm does for the trunk) keeps save
    and load bit-exact in both directions: w + 1 - 1 != w in floating point.
    The computation is the same as mlx-lm's: rms_norm(x, 1 + w) in w's dtype.
    """

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


def held_arrays(obj: Any) -> list[mx.array]:
    """Every array a module tree holds: its parameters and the arrays in private attributes.

    mlx-lm keeps some constants outside `parameters()` (Gemma 4's proportional
    RoPE frequency table `_freqs`, built lazily in the constructor). A lazy
    array carries the stream of the thread that made it, and evaluating it
    from another thread (the serving engine's) fails with "There is no
    Stream(cpu, 0) in current thread".
    """
    out: list[mx.array] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, mx.array):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
            if isinstance(o, nn.Module):
                stack.extend(v for k, v in vars(o).items() if k.startswith("_"))
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return out


def materialize(*modules: Any, one_at_a_time: bool = False) -> None:
    """Evaluates every array the modules hold (`held_arrays`), so any thread may use them.

    `one_at_a_time`: one evaluation per array, so that what an array is cut
    from (a whole lazily loaded tensor a shard slices) can be freed before
    the next is read.
    """
    arrays = [a for m in modules for a in held_arrays(m)]
    if one_at_a_time:
        for a in arrays:
            mx.eval(a)
    else:
        mx.eval(arrays)


def take_prefixed(weights: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Removes and returns the entries of `weights` whose key starts with prefix."""
    keys = [k for k in weights if k.startswith(prefix)]
    return {k: weights.pop(k) for k in keys}


def stack_experts(weights: dict[str, mx.array], mlp_prefix: str, num_experts: int) -> None:
    """Brings HF expert weights into mlx-lm's `switch_mlp` layout, in place.

    Accepts one tensor per expert (Qwen3-Next) or the fused
    `experts.gate_up_proj` / `experts.down_proj` tensors (Qwen3.5 MoE).
    """
    fused = f"{mlp_prefix}.experts.gate_up_proj"
    if fused in weights:
        gate_up = weights.pop(fused)
        mid = gate_up.shape[-2] // 2
        weights[f"{mlp_prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{mlp_prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{mlp_prefix}.switch_mlp.down_proj.weight"] = weights.pop(
            f"{mlp_prefix}.experts.down_proj"
        )
        return
    if f"{mlp_prefix}.experts.0.up_proj.weight" not in weights:
        return
    for n in ("up_proj", "down_proj", "gate_proj"):
        parts = [weights.pop(f"{mlp_prefix}.experts.{e}.{n}.weight") for e in range(num_experts)]
        weights[f"{mlp_prefix}.switch_mlp.{n}.weight"] = mx.stack(parts)


class FlatBlockHead(MTPHead):
    """A head whose decoder layer's weights sit directly under its prefix.

    DeepSeek and MiMo checkpoints store the layer's `self_attn.*`, `mlp.*`
    and norms next to the head's own modules. The module keeps the layer as
    `block`; names outside `own_modules` map to it. All head weights pass
    through the trunk family's own `sanitize` (expert stacking, MLA weight
    splitting, fp8 dequantisation) as if they were trunk layer 0.
    """

    own_modules: tuple[str, ...] = ()
    ignored_modules: tuple[str, ...] = ()

    def __init__(self, args: HeadArgs, trunk: nn.Module, prefix: str, module: int = 0):
        super().__init__(args, trunk, module)
        self.prefix = prefix
        text = trunk_lib.text_model(trunk)
        self._trunk_cls = type(text)
        self._trunk_args = text.args

    def layer_list(self) -> list[nn.Module]:
        return [self.block]

    def to_checkpoint_name(self, name: str) -> str:
        if name.startswith("block."):
            name = name[len("block."):]
        return self.prefix + name

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        lead = "model.layers.0."
        staged = {
            lead + k[len(self.prefix):]: v
            for k, v in weights.items()
            if k.startswith(self.prefix)
            and k[len(self.prefix):].split(".", 1)[0] not in self.ignored_modules
        }
        if staged and hasattr(self._trunk_cls, "sanitize"):
            shim = SimpleNamespace(args=self._trunk_args)
            staged = self._trunk_cls.sanitize(shim, staged)
        out = {}
        for k, v in staged.items():
            if k.startswith(lead):
                name = k[len(lead):]
                own = name.split(".", 1)[0] in self.own_modules
                out[name if own else "block." + name] = v
        return out
