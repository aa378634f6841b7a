"""Writing MTP runtimes: the trunk as mlx-lm stores it, the head in its own file.

`save_runtime` writes config.json, the trunk in `model*.safetensors` (sharded
and named as mlx-lm's `save_model` does, so `mlx_lm.load` reads it strictly)
and every MTP module under its layout's checkpoint names in `mtp.safetensors`,
a file mlx-lm's loader does not read; `load` reads the folder back.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mtplx_ext import models
from mtplx_ext._checks import as_int
from mtplx_ext.checkpoints.loading import HEAD_FILE, INDEX_FILE
from mtplx_ext.models.packed_linear import linears_unpacked
from mtplx_ext.models.runtime import MTPRuntime


def save_runtime(runtime: MTPRuntime, path: str | Path) -> None:
    """Writes config.json, model.safetensors (trunk), mtp.safetensors (head), the index and tokenizer.json.

    Raises:
        FileExistsError: if the folder already holds other *.safetensors
            files, which `load` would merge in.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with linears_unpacked(runtime):  # files hold row-major weights
        trunk_w = dict(tree_flatten(runtime.trunk.parameters()))
        head_w = head_checkpoint_weights(runtime)
    ours = {name for name, _ in trunk_shards(trunk_w)} | ({HEAD_FILE} if head_w else set())
    stale = sorted(f.name for f in path.glob("*.safetensors") if f.name not in ours)
    if stale:
        raise FileExistsError(f"{str(path)!r} already holds other weight files: {stale}")
    write_weights(path, trunk_w, head_w)
    config = dict(runtime.config)
    config["mtp_head_layout"] = runtime.head_layout
    if runtime.head is not None:
        config["mtp_hidden_source"] = runtime.hidden_source
    else:
        config.pop("mtp_hidden_source", None)
    write_config(path, config)
    if runtime.tokenizer is not None:
        runtime.tokenizer.save(str(path / "tokenizer.json"))


def add_mtp_modules(runtime: MTPRuntime, count: int) -> None:
    """Grows a runtime's head to `count` MTP modules, each new one a copy of the last (e.g. to fine-tune).

    Raises:
        ValueError: no head, or `count` below the modules it has.
    """
    mods = runtime.mtp_modules
    if not mods:
        raise ValueError("this model has no MTP head to add modules to")
    count = as_int("count", count, lo=len(mods))
    if count == len(mods):
        return
    layout = models.layout_module(runtime.head_layout)
    last = mods[-1]
    for i in range(len(mods), count):
        m = layout.Model(runtime.head.args, runtime.trunk, module=i, first=runtime.head)
        # The last module's tensors of the same names (a later qwen3_next module
        # has only its layer: the combination and norm stay the first's), copied.
        want = {k: v.shape for k, v in tree_flatten(m.parameters())}
        src = {k: v for k, v in tree_flatten(last.parameters()) if k in want}
        if {k: v.shape for k, v in src.items()} != want:
            raise ValueError("cannot copy a quantized MTP module: add modules to the float model, then quantize")
        m.load_weights([(k, mx.array(v)) for k, v in src.items()], strict=True)
        mods.append(m)
    runtime["more_modules"] = mods[1:]
    config = dict(runtime.config)
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers" if "mtp_num_hidden_layers" in text else "num_nextn_predict_layers"] = count
    object.__setattr__(runtime, "_config", config)
    mx.eval(runtime.parameters())


def head_checkpoint_weights(runtime: MTPRuntime) -> dict[str, mx.array]:
    """Every MTP module's tensors under checkpoint names (tensors modules share appear once)."""
    out: dict[str, mx.array] = {}
    for m in runtime.mtp_modules:
        out.update(m.checkpoint_weights())
    return out


def trunk_shards(trunk_w: dict[str, mx.array]) -> list[tuple[str, dict[str, mx.array]]]:
    """(file name, tensors) of the trunk's shards, split and named as mlx-lm's `save_model` does."""
    from mlx_lm.utils import make_shards

    shards = make_shards(trunk_w) or [{}]
    if len(shards) == 1:
        return [("model.safetensors", shards[0])]
    return [(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", sh) for i, sh in enumerate(shards)]


def write_weights(path: Path, trunk_w: dict[str, mx.array], head_w: dict[str, mx.array]) -> None:
    """The trunk's tensors in model*.safetensors, the head's in mtp.safetensors, and the index."""
    wm = {}
    for name, shard in trunk_shards(trunk_w):
        mx.save_safetensors(str(path / name), shard, metadata={"format": "mlx"})
        wm.update({k: name for k in shard})
    if head_w:
        mx.save_safetensors(str(path / HEAD_FILE), head_w, metadata={"format": "mlx"})
    wm.update({k: HEAD_FILE for k in head_w})
    total = sum(v.nbytes for v in (*trunk_w.values(), *head_w.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_config(path: Path, config: dict) -> None:
    """config.json, with mlx-lm's `quantization_config` mirror of `quantization`."""
    config = dict(config)
    if "quantization" in config:
        config["quantization_config"] = config["quantization"]
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = ["add_mtp_modules", "head_checkpoint_weights", "save_runtime", "trunk_shards", "write_config", "write_weights"]
