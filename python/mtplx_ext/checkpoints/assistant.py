"""Gemma 4 assistant folders: load one beside its target, check the pair, convert it.

`load(target, drafter=assistant)` builds the target as `loading.load` does
(without a head of its own) and attaches the assistant as its drafter: a
runtime whose `head` is a `Gemma4Assistant` (`head_layout`
"gemma4_assistant"), decoded by `engine.drafter.FrozenKV`.

A pair that cannot work is refused in one line naming the field, before any
kernel runs: a target that is not a Gemma 4 text model, a
`backbone_hidden_size` other than the target's `hidden_size`, another
`vocab_size`, an assistant layer type the target has no K/V-storing layer
of (`layer_types`), or query heads that do not fit the target's K/V
(`head_dim` / `global_head_dim`, `num_attention_heads`).

`convert_assistant(src, out, quantize=...)` writes the MLX folder: the
config as read (with `per_layer_config` mapped), the tensors under their
checkpoint names, quantized with mlx-lm's rule when asked (the same bits and
group size as the trunk's conversion; `token_ordering` and the norms stay as
they are).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtplx_ext._checks import CheckpointError
from mtplx_ext.checkpoints import loading
from mtplx_ext.checkpoints import quantize as quant
from mtplx_ext.models import gemma4_trunk
from mtplx_ext.models.base import materialize
from mtplx_ext.models.gemma4_assistant import LAYOUT, AssistantArgs, Gemma4Assistant
from mtplx_ext.models.runtime import MTPRuntime

ASSISTANT_TYPES = ("gemma4_assistant",)


def _args(config: dict, where: str) -> AssistantArgs:
    if config.get("model_type") not in ASSISTANT_TYPES:
        raise CheckpointError(
            f"{where}: model_type {config.get('model_type')!r} is not a drafter this package reads "
            f"(supported: {', '.join(ASSISTANT_TYPES)})"
        )
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: text_config is missing (a gemma4_assistant config nests its decoder there)")
    loading.check_config({**text, "model_type": "gemma4_text"}, f"{where}: text_config")
    bb = config.get("backbone_hidden_size")
    if isinstance(bb, bool) or not isinstance(bb, int) or bb <= 0:
        raise CheckpointError(f"{where}: backbone_hidden_size must be a positive integer, got {bb!r}")
    for name in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(name):
            raise CheckpointError(f"{where}: text_config.{name} must be 0 for an assistant, got {text[name]!r}")
    if text.get("enable_moe_block"):
        raise CheckpointError(f"{where}: text_config.enable_moe_block is not supported in an assistant")
    try:
        args = AssistantArgs.from_config(config)
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{where} does not describe a Gemma 4 assistant: {loading.one_line(e)}") from None
    if args.use_ordered_embeddings:
        c, k, v = args.num_centroids, args.centroid_intermediate_top_k, args.text.vocab_size
        if c <= 0 or v % c:
            raise CheckpointError(f"{where}: num_centroids = {c} must divide vocab_size = {v}")
        if not 0 < k <= c:
            raise CheckpointError(f"{where}: centroid_intermediate_top_k = {k} must be in [1, num_centroids = {c}]")
    return args


def check_pair(trunk: nn.Module, assistant: Gemma4Assistant, where: str) -> None:
    """Refuses an assistant that cannot draft for `trunk`, naming the field (see the module docstring)."""
    if not gemma4_trunk.is_gemma4(trunk):
        family = type(trunk).__module__.rsplit(".", 1)[-1]
        raise CheckpointError(
            f"{where}: a Gemma 4 assistant drafts for gemma4_text targets; the target's model_type is {family!r}"
        )
    a, t = assistant.args, trunk.args
    if a.backbone_hidden_size != t.hidden_size:
        raise CheckpointError(
            f"{where}: backbone_hidden_size = {a.backbone_hidden_size} does not match the target's hidden_size = {t.hidden_size}"
        )
    if a.text.vocab_size != t.vocab_size:
        raise CheckpointError(
            f"{where}: text_config.vocab_size = {a.text.vocab_size} does not match the target's vocab_size = {t.vocab_size}"
        )
    sources = gemma4_trunk.kv_sources(trunk)
    for i, layer in enumerate(assistant.model.layers):
        kind = layer.layer_type
        if kind not in sources:
            raise CheckpointError(
                f"{where}: text_config.layer_types[{i}] = {kind!r}, but the target has no {kind} layer storing K/V"
            )
        kv_heads, dim = gemma4_trunk.kv_shape(trunk, kind)
        attn = layer.self_attn
        if attn.head_dim != dim:
            field = "global_head_dim" if kind == "full_attention" else "head_dim"
            raise CheckpointError(
                f"{where}: text_config.{field} = {attn.head_dim} does not match the target's {kind} K/V head size {dim}"
            )
        if attn.n_heads % kv_heads:
            raise CheckpointError(
                f"{where}: text_config.num_attention_heads = {attn.n_heads} is not a multiple of the target's "
                f"{kind} K/V heads ({kv_heads})"
            )


def build_assistant(
    config: dict, weights: dict[str, mx.array] | None, where: str, trunk: nn.Module | None = None
) -> Gemma4Assistant:
    """The assistant a config describes, with its (possibly quantized) weights loaded strictly.

    With `trunk`, the pair is checked (`check_pair`) before any weight is read.
    """
    assistant = Gemma4Assistant(_args(config, where))
    if trunk is not None:
        check_pair(trunk, assistant, where)
    if weights is not None:
        weights = assistant.sanitize(dict(weights))
        if "quantization" in config:
            q = quant.check_config_quantization(config, where)
            quant.quantize_for_load(assistant, q, weights)
        loading.load_strict(assistant, weights, f"drafter weights ({where})", lambda k: k)
    materialize(assistant)
    return assistant


def attach(runtime: MTPRuntime, drafter: str | Path) -> MTPRuntime:
    """A runtime of `runtime`'s trunk with the assistant folder `drafter` as its drafter."""
    path = Path(drafter)
    config = loading.read_config(path)
    where = str(path / "config.json")
    assistant = build_assistant(config, loading.read_weights(path), where, runtime.trunk)
    cfg = {**runtime.config, "mtp_head_layout": LAYOUT, "mtp_hidden_source": assistant.args.hidden_source}
    return MTPRuntime(runtime.trunk, assistant, cfg, runtime.tokenizer)


def load(path: str | Path, *, fuse_cpu_ops: bool = True, drafter: str | Path | None = None) -> MTPRuntime:
    """`loading.load`, optionally with a Gemma 4 assistant folder as the drafter.

    Args:
        path: the target's folder.
        fuse_cpu_ops: as in `loading.load` (trunk and assistant).
        drafter: a `gemma4_assistant` folder (Hugging Face or converted), or None.

    Raises:
        CheckpointError: as `loading.load`, or a drafter that does not fit the target.
    """
    if drafter is None:
        return loading.load(path, fuse_cpu_ops=fuse_cpu_ops)
    runtime = attach(loading.load(path, fuse_cpu_ops=False), drafter)
    if fuse_cpu_ops:
        runtime.fuse_cpu_ops()
    return runtime


def convert_assistant(
    src: str | Path, out: str | Path, *, quantize: dict | None = None, target: MTPRuntime | None = None
) -> Path:
    """Writes the MLX folder of a Hugging Face assistant (config.json, model.safetensors).

    Args:
        quantize: {"bits", "group_size"[, "mode"]} to quantize the Linear and
            Embedding layers with mlx-lm's rule, or None to keep the dtype.
        target: checks the pair against this runtime first.
    """
    src, out = Path(src), Path(out)
    config = loading.read_config(src)
    where = str(src / "config.json")
    assistant = build_assistant(config, loading.read_weights(src), where, None if target is None else target.trunk)
    config = dict(config)
    if quantize is not None:
        q = quant.check_quantization(dict(quantize), "quantize")
        nn.quantize(assistant, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"))
        config["quantization"] = q
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"output folder {str(out)!r} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(assistant.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


__all__: list[Any] = ["ASSISTANT_TYPES", "attach", "build_assistant", "check_pair", "convert_assistant", "load"]
