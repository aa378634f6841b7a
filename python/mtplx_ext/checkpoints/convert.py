"""Hugging Face checkpoint -> MLX model folder that keeps the MTP head.

    mtplx-ext convert HF_FOLDER OUT [-q] [--q-bits 4] [--q-group-size 64] [--mtp-bits B] [--dtype bfloat16]
    mtplx-ext convert --mtp-from HF_FOLDER MLX_FOLDER OUT

mlx-lm's `sanitize` drops every MTP tensor, so `mlx_lm.convert` output has no
head. `convert` runs the same steps as mlx-lm (the family's `sanitize`, the
dtype cast with its `cast_predicate`, `quantize_model`) on the trunk and
keeps the head, quantized at `mtp_bits`. `add_mtp` adds the head of the
original checkpoint to an existing MLX conversion, reading only the shards
the index says hold MTP tensors.

Norm conventions, each applied exactly once: the trunk's norms go through
mlx-lm's own `sanitize` (for Qwen3-Next / Qwen3.5 it adds 1 to the
zero-centred weights, and the folder stores them shifted, as mlx-lm does);
the head's norms are stored as the checkpoint has them (zero-centred for
the Qwen3-Next layout) and `ZeroCentredRMSNorm` adds the 1 when it runs.
Nothing else ever shifts a head norm.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from mtplx_ext import models
from mtplx_ext.checkpoints import quantize as quant
from mtplx_ext._checks import CheckpointError
from mtplx_ext.checkpoints.loading import (
    HEAD_FILE,
    INDEX_FILE,
    build_runtime,
    read_config,
    read_index,
    read_safetensors,
    read_weights,
    weight_files,
)
from mtplx_ext.checkpoints.saving import head_checkpoint_weights, write_config, write_weights
from mtplx_ext.models import trunk as trunk_lib

DTYPES = ("bfloat16", "float16", "float32")

#: Files copied from the source folder besides weights and config.json.
_SIDE_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.*",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template*",
)

#: Keep the head's [H, 2H] fusion projection in float when quantizing.
#: Measured on the shipped model (bench/RESULTS.md, "Quantized checkpoints").
KEEP_FUSION_FLOAT = False


def _progress(items: list, desc: str, enabled: bool) -> Any:
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="shard", file=sys.stderr, leave=False)


def head_prefix(layout: str, config: dict) -> str:
    """Checkpoint prefix of a layout's head tensors for a config."""
    if layout == "deepseek":
        return models.deepseek_head.prefix_for(trunk_lib.text_config(config))
    return models.layout_module(layout).PREFIX


def is_head_key(layout: str, config: dict, key: str) -> bool:
    """Whether a checkpoint key belongs to one of the head's MTP modules (any of them)."""
    return models.layout_module(layout).is_head_key(trunk_lib.text_config(config), key)


def family_layout(config: dict, where: str) -> str:
    """The head layout a trunk family's published checkpoints use."""
    mt = config["model_type"]
    if mt not in models.FAMILY_DEFAULT_LAYOUT:
        raise CheckpointError(
            f"{where}: model_type {mt!r} has no known MTP layout; convert supports "
            + ", ".join(sorted(models.FAMILY_DEFAULT_LAYOUT))
        )
    return models.FAMILY_DEFAULT_LAYOUT[mt]


def _weight_names(path: Path, all_shards: bool = True) -> dict[str, str]:
    """tensor name -> file, from the index, or from each file's header.

    With `all_shards`, a shard the index names but the folder lacks is an error.
    """
    if (path / INDEX_FILE).is_file():
        if all_shards:
            weight_files(path)
        return read_index(path)
    return {k: f.name for f in weight_files(path) for k in read_safetensors(f)}


def _no_head_error(path: Path, prefix: str) -> CheckpointError:
    return CheckpointError(
        f"{path} holds no MTP head tensors ({prefix}*): mlx-lm conversions drop them; add the head from the "
        "original checkpoint with `mtplx-ext convert --mtp-from HF_FOLDER MLX_FOLDER OUT`"
    )


def target_dtype(config: dict, dtype: str | None) -> mx.Dtype | None:
    """The dtype to store float weights in: `dtype`, else the config's own, else None (as stored)."""
    if dtype is None:
        text = trunk_lib.text_config(config)
        dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
        if dtype not in DTYPES:
            return None
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return getattr(mx, dtype)


def cast_runtime(runtime: Any, dtype: mx.Dtype | None) -> None:
    """Casts float parameters as `mlx_lm.convert` does (the family's `cast_predicate` holds some back)."""
    if dtype is None:
        return
    keep = getattr(runtime.trunk, "cast_predicate", lambda _: True)

    def cast(path: str, v: mx.array) -> mx.array:
        trunk_path = path[len("trunk."):] if path.startswith("trunk.") else None
        if mx.issubdtype(v.dtype, mx.floating) and (trunk_path is None or keep(trunk_path)):
            return v.astype(dtype)
        return v

    runtime.update(tree_map_with_path(cast, runtime.parameters()))
    mx.eval(runtime.parameters())


def _check_out(out: Path, sources: list[Path]) -> None:
    if any(out.resolve() == s.resolve() for s in sources):
        raise CheckpointError(f"output folder {str(out)!r} is also an input folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {str(out)!r} is a file, not a folder: give a new or empty folder")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output folder {str(out)!r} already exists and is not empty")


@contextlib.contextmanager
def _output_folder(out: Path, sources: list[Path]):
    """Creates `out`; removes what was written there when the conversion fails."""
    _check_out(out, sources)
    existed = out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for f in out.iterdir():
            f.unlink()
        if not existed:
            out.rmdir()
        raise


def _copy_side_files(src: Path, out: Path) -> None:
    for pattern in _SIDE_FILES:
        for f in src.glob(pattern):
            if f.is_file() and not (out / f.name).exists():
                shutil.copy2(f, out / f.name)


def _output_config(config: dict) -> dict:
    config = dict(config)
    # As mlx-lm's save_config: no source path, no vision tower (its trunk has none).
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    return config


def bits_per_weight(runtime: Any) -> float:
    from mlx_lm.utils import compute_bits_per_weight

    return float(compute_bits_per_weight(runtime))


def convert(
    hf_path: str | Path,
    out: str | Path,
    *,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    mtp_bits: int | None | object = ...,
    keep_fusion_float: bool | None = None,
    dtype: str | None = None,
    progress: bool = False,
) -> dict:
    """Converts a Hugging Face folder to an MLX folder with its MTP head.

    Args:
        hf_path: config.json, safetensors shards (with their index) and
            tokenizer files, as published.
        out: new (or empty) output folder.
        quantize: quantize trunk and head (mlx-lm's affine quantization).
        q_bits, q_group_size: the trunk's quantization.
        mtp_bits: the head's bits; default the trunk's, None keeps it float.
        keep_fusion_float: keep the head's fusion projection in float
            (default `KEEP_FUSION_FLOAT`).
        dtype: "bfloat16", "float16" or "float32" for the float weights;
            default the config's `torch_dtype`, else as stored.
        progress: progress bar over the shards on stderr.

    Returns:
        A summary: layout, head tensor count, bits per weight, bytes.

    Raises:
        CheckpointError: no MTP tensors, bad config, bad tensors.
    """
    hf_path, out = Path(hf_path), Path(out)
    config = read_config(hf_path)
    where = str(hf_path / "config.json")
    layout = family_layout(config, where)
    prefix = head_prefix(layout, config)
    names = _weight_names(hf_path)
    if not any(k.startswith(prefix) for k in names):
        raise _no_head_error(hf_path, prefix)
    cast_to = target_dtype(config, dtype)
    if quantize:
        quant.check_quantization({"group_size": q_group_size, "bits": q_bits}, "--q-bits / --q-group-size")
    with _output_folder(out, [hf_path]):
        files = weight_files(hf_path)
        weights = read_weights(hf_path, files, progress=lambda fs: _progress(fs, "reading shards", progress))
        rt = build_runtime({**config, "mtp_head_layout": layout}, weights, where=where)
        del weights
        cast_runtime(rt, cast_to)
        if quantize:
            quant.quantize_runtime(
                rt, q_bits, q_group_size, "affine", mtp_bits,
                KEEP_FUSION_FLOAT if keep_fusion_float is None else keep_fusion_float,
            )
        return _write(rt, hf_path, out, layout)


def _write(rt: Any, src: Path, out: Path, layout: str, trunk_from: Path | None = None) -> dict:
    head_w = head_checkpoint_weights(rt)
    if trunk_from is None:
        trunk_w = dict(tree_flatten(rt.trunk.parameters()))
        write_weights(out, trunk_w, head_w)
    else:
        trunk_w = {}
        _copy_trunk(trunk_from, out, head_w)
    config = _output_config(rt.config)
    config["mtp_head_layout"] = layout
    config["mtp_hidden_source"] = rt.hidden_source
    write_config(out, config)
    _copy_side_files(src, out)
    return {
        "layout": layout,
        "head_tensors": len(head_w),
        "bits_per_weight": bits_per_weight(rt),
        "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
    }


def _copy_trunk(mlx_path: Path, out: Path, head_w: dict[str, mx.array]) -> None:
    """Copies an MLX folder's trunk shards byte for byte and writes the head next to them."""
    import json

    files = [f for f in weight_files(mlx_path) if f.name != HEAD_FILE]
    for f in files:
        shutil.copy2(f, out / f.name)
    mx.save_safetensors(str(out / HEAD_FILE), head_w, metadata={"format": "mlx"})
    if (mlx_path / INDEX_FILE).is_file():
        wm = read_index(mlx_path)
        meta = json.loads((mlx_path / INDEX_FILE).read_text()).get("metadata", {})
    else:
        wm = {k: f.name for f in files for k in read_safetensors(f)}
        meta = {}
    wm = {**wm, **{k: HEAD_FILE for k in head_w}}
    index = {"metadata": meta, "weight_map": dict(sorted(wm.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _trunk_float_dtype(rt: Any) -> mx.Dtype:
    """The dtype most of the trunk's float tensors (scales included) are stored in."""
    counts: dict[Any, int] = {}
    for _, v in tree_flatten(rt.trunk.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            counts[v.dtype] = counts.get(v.dtype, 0) + v.size
    return max(counts, key=counts.get) if counts else mx.float32


def add_mtp(
    hf_path: str | Path,
    mlx_path: str | Path,
    out: str | Path,
    *,
    mtp_bits: int | None | object = ...,
    keep_fusion_float: bool | None = None,
    progress: bool = False,
) -> dict:
    """Adds the MTP head of a Hugging Face checkpoint to an MLX conversion that lost it.

    Reads only the shards the index names for MTP tensors; the trunk's
    files are copied unchanged. The head is cast to the trunk's float dtype
    and quantized like the trunk (its `quantization` bits and group size)
    unless `mtp_bits` says otherwise.

    Raises:
        CheckpointError: mismatching models, no MTP tensors in `hf_path`,
            a head already in `mlx_path`.
    """
    hf_path, mlx_path, out = Path(hf_path), Path(mlx_path), Path(out)
    hf_cfg, mlx_cfg = read_config(hf_path), read_config(mlx_path)
    where = str(hf_path / "config.json")
    layout = family_layout(hf_cfg, where)
    prefix = head_prefix(layout, hf_cfg)
    ht, mt = trunk_lib.text_config(hf_cfg), trunk_lib.text_config(mlx_cfg)
    if hf_cfg["model_type"] != mlx_cfg["model_type"]:
        raise CheckpointError(
            f"{mlx_path} is a {mlx_cfg['model_type']!r} model, {hf_path} a {hf_cfg['model_type']!r} one"
        )
    for field in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if ht.get(field) != mt.get(field):
            raise CheckpointError(
                f"{field} differs: {ht.get(field)!r} in {hf_path / 'config.json'}, "
                f"{mt.get(field)!r} in {mlx_path / 'config.json'}"
            )
    names = _weight_names(hf_path, all_shards=False)
    shards = sorted({f for k, f in names.items() if is_head_key(layout, hf_cfg, k)})
    if not shards:
        raise _no_head_error(hf_path, prefix)
    for f in shards:
        if not (hf_path / f).is_file():
            raise FileNotFoundError(f"{hf_path / INDEX_FILE} puts MTP tensors in {f!r}, which is missing from the folder")
    mlx_names = _weight_names(mlx_path)
    if any(is_head_key(layout, mlx_cfg, k) for k in mlx_names):
        raise CheckpointError(f"{mlx_path} already holds MTP head tensors ({prefix}*)")
    with _output_folder(out, [hf_path, mlx_path]):
        return _add_head(hf_path, mlx_path, out, layout, shards, ht, mt, mlx_cfg, mtp_bits, keep_fusion_float, progress)


def _without_head_quantization(config: dict, layout: str) -> dict:
    """`config` without per-module quantization entries of the head's modules.

    A headless folder may still record how a head it once had was quantized
    (e.g. `"mtp.fc": {...}` under `quantization`); those entries describe
    tensors that are not there, and the head added now writes its own.
    """
    out = dict(config)
    for field in ("quantization", "quantization_config"):
        q = out.get(field)
        if isinstance(q, dict):
            out[field] = {k: v for k, v in q.items()
                          if not (isinstance(v, (dict, bool)) and is_head_key(layout, config, k + ".weight"))}
    return out


def _add_head(
    hf_path: Path,
    mlx_path: Path,
    out: Path,
    layout: str,
    shards: list[str],
    ht: dict,
    mt: dict,
    mlx_cfg: dict,
    mtp_bits: int | None | object,
    keep_fusion_float: bool | None,
    progress: bool,
) -> dict:
    """`add_mtp`'s work once the inputs are checked: read the head, cast, quantize, write."""
    head_w: dict[str, mx.array] = {}
    for f in _progress(shards, "reading MTP shards", progress):
        part = read_safetensors(hf_path / f)
        head_w.update({k: v for k, v in part.items() if is_head_key(layout, ht, k)})
    trunk_w = read_weights(mlx_path)
    config = {**_without_head_quantization(mlx_cfg, layout), "mtp_head_layout": layout}
    for field in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if field in ht and field not in mt:
            config[field] = ht[field]
    rt = build_runtime(config, {**trunk_w, **head_w}, where=str(mlx_path / "config.json"))
    dtype = _trunk_float_dtype(rt)
    q = rt.config.get("quantization")
    q = None if q is None else dict(q)
    for head in rt.mtp_modules:
        head.update(tree_map_with_path(
            lambda _, v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v, head.parameters()
        ))
        if q is not None:
            bits = q["bits"] if mtp_bits is ... else mtp_bits
            keep = KEEP_FUSION_FLOAT if keep_fusion_float is None else keep_fusion_float
            fusion = head.to_checkpoint_name(head.fusion_module + ".weight")[: -len(".weight")]
            quant.quantize_head(
                head, rt.trunk, q, bits, q["group_size"], q.get("mode", "affine"), lambda n, f=fusion: keep and n == f
            )
    if q is not None:
        object.__setattr__(rt, "_config", {**rt.config, "quantization": q, "quantization_config": q})
    mx.eval(rt.parameters())
    return _write(rt, mlx_path, out, layout, trunk_from=mlx_path)
