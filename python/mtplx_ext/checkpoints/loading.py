"""Loading MTP runtimes from model folders.

A model folder is Hugging Face-style: config.json, one or more
*.safetensors files (with `model.safetensors.index.json` when sharded) and,
optionally, tokenizer.json. `mtplx_ext.checkpoints.saving` writes the trunk as mlx-lm stores it, in
`model*.safetensors` (so `mlx_lm.load` reads it, strictly), and the head under
its layout's checkpoint names and conventions in `mtp.safetensors`, a file
mlx-lm's loader does not read. Quantized folders carry mlx-lm's
`quantization` config; see `mtplx_ext.checkpoints.quantize`.

Every problem with a folder raises `CheckpointError` (a `ValueError`) or a
`FileNotFoundError`, in one line naming the file, field or tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtplx_ext import models
from mtplx_ext.checkpoints import quantize as quant
from mtplx_ext.checkpoints import gemma4
from mtplx_ext.checkpoints.gemma4 import map_per_layer_config
from mtplx_ext.checkpoints.rope import map_rope_parameters
from mtplx_ext._checks import CheckpointError
from mtplx_ext.models import trunk as trunk_lib
from mtplx_ext.models.base import materialize, take_prefixed
from mtplx_ext.models.runtime import MTPRuntime


#: Sentinel for "the family's own head layout" (None means no head).
FAMILY_LAYOUT = object()

#: The head's own weight file: mlx-lm reads `model*.safetensors` only.
HEAD_FILE = "mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"model path {str(path)!r} is not a folder")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
    try:
        config = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{cfg} has no model_type field")
    return map_per_layer_config(map_rope_parameters(config, str(cfg)), str(cfg))


# Fields every trunk family needs; mlx-lm would otherwise fail deep inside a
# constructor or silently use a dataclass default (Qwen3.5 has 4096 for H).
_REQUIRED_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL_INTS = ("num_key_value_heads", "intermediate_size", "head_dim", "moe_intermediate_size")


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def check_config(config: dict, where: str = "config") -> None:
    """Checks the fields the trunk and head are built from, before anything is built.

    Raises:
        CheckpointError: naming `where` and the field.
    """
    if gemma4.is_wrapper(config):
        gemma4.wrapper_config(config, where)  # the text config is where the fields are
    text = trunk_lib.text_config(config)
    for name in _REQUIRED_INTS + _OPTIONAL_INTS:
        if name not in text:
            if name in _REQUIRED_INTS:
                raise CheckpointError(f"{where}: required field {name!r} is missing")
            continue
        v = text[name]
        if v is None and name in _OPTIONAL_INTS:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CheckpointError(f"{where}: {name} must be a positive integer, got {v!r}")
    thetas = [("rope_theta", text.get("rope_theta"))]
    for nest in ("rope_parameters", "rope_scaling"):
        if isinstance(text.get(nest), dict):
            thetas.append((f"{nest}.rope_theta", text[nest].get("rope_theta")))
    for name, v in thetas:
        if v is not None and not _positive_number(v):
            raise CheckpointError(f"{where}: {name} must be a positive finite number, got {v!r}")
    eps = text.get("rms_norm_eps")
    if eps is not None and not _positive_number(eps):
        raise CheckpointError(f"{where}: rms_norm_eps must be a positive finite number, got {eps!r}")


def one_line(e: BaseException) -> str:
    """An exception's message as one line (its first), for errors that name a file."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_safetensors(file: Path) -> dict[str, mx.array]:
    """Tensors of one safetensors file (loaded lazily by MLX).

    Raises:
        CheckpointError: naming the file when it is empty or not safetensors.
    """
    size = file.stat().st_size
    if size < 8:
        raise CheckpointError(
            f"{file} is not a safetensors file: {size} bytes (the format starts with an 8-byte header length)"
        )
    try:
        return mx.load(str(file))
    except Exception as e:  # MLX raises a bare RuntimeError / ValueError on a bad header
        raise CheckpointError(f"{file} is not a readable safetensors file: {one_line(e)}") from None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: those its index names, else all of them.

    With `model.safetensors.index.json` exactly the files it names are read
    (Hugging Face repositories may hold other, unlisted copies), plus the
    head file `save` writes.

    Raises:
        FileNotFoundError: no weights, or a shard the index names is absent.
        CheckpointError: an unreadable index.
    """
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(read_index(path).values()))
        for n in names:
            if not (path / n).is_file():
                raise FileNotFoundError(f"{index} names shard {n!r}, which is missing from the folder")
        if (path / HEAD_FILE).is_file() and HEAD_FILE not in names:
            names.append(HEAD_FILE)
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {str(path)!r} has no *.safetensors files")
    return files


def read_index(path: Path) -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file) of a folder's index."""
    index = path / INDEX_FILE
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index} is not valid JSON: {e}") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor name -> shard file")
    for k, v in wm.items():
        if Path(v).name != v or not v.endswith(".safetensors"):
            raise CheckpointError(f"{index}: tensor {k!r} maps to {v!r}, not a safetensors file in the folder")
    return wm


def read_weights(
    path: Path, files: list[Path] | None = None, progress: Callable[[Any], Any] | None = None
) -> dict[str, mx.array]:
    """All tensors of a folder's weight files, checked against its index.

    Args:
        path: the model folder.
        files: the files to read (default: `weight_files(path)`).
        progress: wraps the file list (e.g. a progress bar).

    Raises:
        CheckpointError: an unreadable file, a tensor the index puts in a
            shard that lacks it, or a tensor stored twice.
    """
    files = weight_files(path) if files is None else files
    index = read_index(path) if (path / INDEX_FILE).is_file() else None
    weights: dict[str, mx.array] = {}
    for f in progress(files) if progress else files:
        part = read_safetensors(f)
        twice = next((k for k in part if k in weights), None)
        if twice is not None:
            raise CheckpointError(f"tensor {twice!r} is stored twice, the second time in {f}")
        weights.update(part)
        if index is not None:
            lost = next((k for k, v in index.items() if v == f.name and k not in part), None)
            if lost is not None:
                raise CheckpointError(f"{path / INDEX_FILE} puts tensor {lost!r} in {f.name}, which does not hold it")
    return weights


def read_tokenizer(path: Path) -> Any:
    """The folder's tokenizer.json as a `tokenizers.Tokenizer`, or None."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception
        raise CheckpointError(f"{file} is not a valid tokenizer file: {one_line(e)}") from None


def load_strict(module: nn.Module, weights: dict[str, mx.array], what: str, name_of: Callable[[str], str]) -> None:
    """`load_weights(strict=True)` with errors naming checkpoint keys.

    Raises:
        CheckpointError: missing, unexpected or wrongly shaped tensors.
    """
    expected = dict(tree_flatten(module.parameters()))
    missing = [name_of(k) for k in expected if k not in weights]
    extra = [name_of(k) for k in weights if k not in expected]

    def listing(keys: list[str]) -> str:
        return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")

    if missing:
        raise CheckpointError(f"{what} is missing {len(missing)} tensor(s): {listing(missing)}")
    if extra:
        raise CheckpointError(f"{what}: unexpected tensor(s) {listing(extra)}")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(
                f"{what}: tensor {name_of(k)!r} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}"
            )
    module.load_weights(list(weights.items()), strict=True)


def head_checkpoint_name(head: Any, module_path: str) -> str:
    """Checkpoint name of a head module (its weight's key without `.weight`)."""
    return head.to_checkpoint_name(module_path + ".weight")[: -len(".weight")]


def _declared_mtp_layers(config: dict) -> int:
    text = trunk_lib.text_config(config)
    n = text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0
    return int(n) if isinstance(n, int) and not isinstance(n, bool) else 0


def _mtp_module_count(weights: dict[str, Any] | None, layout_mod: Any, config: dict, where: str) -> int:
    """MTP modules to build: those the weights hold (0, 1, ...), else the config's count.

    Raises:
        CheckpointError: a later layer present while an earlier one is missing.
    """
    declared = _declared_mtp_layers(config)
    if weights is None:
        return max(1, declared)

    def present(i: int) -> bool:
        return any(k.startswith(layout_mod.layer_prefix(config, i)) for k in weights)

    n = 1
    while present(n):
        n += 1
    later = next((i for i in range(n + 1, max(n, declared) + 2) if present(i)), None)
    if later is not None:
        raise CheckpointError(f"{where}: the weights hold MTP layer {later} but layer {n} is missing")
    return n


def _load_head_modules(
    mods: list[Any], weights: dict[str, Any], quantization: dict | None, layout: str, named: bool, where: str
) -> None:
    """Takes every MTP module's tensors out of `weights` and loads them strictly.

    Raises:
        CheckpointError: no head tensors under a named layout, a head tensor
            no module owns (e.g. layer 2 without layer 1), or a module's
            missing / unexpected / misshapen tensors.
    """
    raw: dict[str, Any] = {}
    for m in mods:
        raw.update(take_prefixed(weights, m.prefix))
    if not raw and named:
        raise CheckpointError(
            f"{where} names MTP head layout {layout!r} but the weights hold no MTP head tensors "
            f"({mods[0].prefix}*); add them with `mtplx-ext convert --mtp-from HF_FOLDER MLX_FOLDER OUT`"
        )
    stray = sorted(k for k in raw if not any(m.owns(k) for m in mods))
    if stray:
        more = f" and {len(stray) - 4} more" if len(stray) > 4 else ""
        raise CheckpointError(f"MTP head ({layout}): unexpected tensor(s) {', '.join(stray[:4])}{more}")
    for m in mods:
        head_w = m.sanitize(raw)
        if quantization is not None:
            quant.quantize_for_load(m, quantization, head_w, lambda p, m=m: head_checkpoint_name(m, p))
        load_strict(m, head_w, f"MTP head ({layout}, {m.prefix}*)", m.to_checkpoint_name)


def build_runtime(
    config: dict,
    weights: dict[str, mx.array] | None = None,
    tokenizer: Any = None,
    *,
    where: str = "config",
    prepare: Callable[[MTPRuntime], None] | None = None,
    consume: bool = False,
) -> MTPRuntime:
    """Builds the trunk and head a config describes, optionally loading weights.

    Args:
        config: full config; `mtp_head_layout` picks the head (detected from
            the weight names when absent; None or "none" for no head). A
            `quantization` entry (mlx-lm's) quantizes the layers whose
            weights are stored quantized, head included.
        weights: checkpoint tensors under checkpoint names, or None to keep
            the random initialisation.
        tokenizer: attached to the runtime as is.
        where: names the config's source in error messages.
        prepare: called on the runtime before its parameters are evaluated
            (lazily loaded weights are read only then): `sharded.load`
            splits the model there, so a rank reads only its part.
        consume: the caller hands `weights` over: the dict is emptied once
            the modules hold the tensors, and with `prepare` the arrays are
            then evaluated one at a time. A lazily loaded tensor that
            `prepare` slices is read whole, so this keeps one full tensor
            alive at a time instead of all of them (a rank's peak memory
            near its share rather than the whole model).

    Returns:
        The runtime, parameters evaluated.

    Raises:
        CheckpointError: a config or weights that do not fit, in one line.
    """
    check_config(config, where)
    if "quantization" in config:
        quant.check_config_quantization(config, where)
    elif config.get("quantization_config"):
        qc = config["quantization_config"]
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        if method != "fp8":
            raise CheckpointError(
                f"{where}: quantization_config (quant_method {method!r}) is a Hugging Face quantization; "
                "only mlx-lm's `quantization` and block-fp8 checkpoints are read"
            )
        # Block-fp8 (DeepSeek-V3 / R1): the family's sanitize dequantizes the
        # `weight_scale_inv` pairs, as mlx-lm's load does; the runtime is float.
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    quantization = config.get("quantization")
    wrapped = gemma4.is_wrapper(config)  # multimodal Gemma 4: decode runs its language model
    if wrapped:
        config = gemma4.wrapper_config(config, where)
    arch = trunk_lib.trunk_module(config["model_type"])
    try:
        trunk = arch.Model(arch.ModelArgs.from_dict(config))
    except (TypeError, KeyError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"{where} does not describe an mlx-lm {config['model_type']} model: {one_line(e)}") from None
    layout = config.get("mtp_head_layout", FAMILY_LAYOUT)
    named = layout is not FAMILY_LAYOUT and layout not in (None, "none")
    if layout is FAMILY_LAYOUT:
        layout = models.detect_layout(weights or {}, config)
    mods: list[Any] = []
    if layout not in (None, "none"):
        mod = models.layout_module(layout)
        args = mod.ModelArgs.from_config(config)
        mods = [mod.Model(args, trunk)]
        for i in range(1, _mtp_module_count(weights, mod, config, where)):
            mods.append(mod.Model(args, trunk, module=i, first=mods[0]))
    head = mods[0] if mods else None
    handed = weights
    if weights is not None:
        weights = dict(weights)
        if mods:
            _load_head_modules(mods, weights, quantization, layout, named, where)
        if hasattr(trunk, "sanitize"):
            weights = trunk.sanitize(weights)
        if quantization is not None:
            quant.quantize_for_load(trunk, quantization, weights)
        load_strict(trunk, weights, "trunk weights", lambda k: k)
        if consume:
            handed.clear()
            weights.clear()
    if wrapped:
        trunk, config = gemma4.text_only(trunk, config)
    config = {**config, "mtp_head_layout": layout if head is not None else None}
    if head is not None:
        config["mtp_hidden_source"] = head.args.hidden_source
    runtime = MTPRuntime(trunk, head, config, tokenizer, more_modules=mods[1:])
    if prepare is not None:
        prepare(runtime)
    # Consumed and sliced: each full tensor is freed once its slice is read.
    materialize(runtime, one_at_a_time=consume and prepare is not None)
    return runtime


def load(path: str | Path, *, fuse_cpu_ops: bool = True) -> MTPRuntime:
    """Loads a Hugging Face-style or mlx-lm model folder into an MTP runtime.

    Args:
        path: folder with config.json, *.safetensors (sharded with
            model.safetensors.index.json, quantized as mlx-lm quantizes, or
            neither) and optionally tokenizer.json.
        fuse_cpu_ops: swap RMSNorm / RoPE modules for single-node fused ones
            and route attention through the fused op while decoding
            (`MTPRuntime.fuse_cpu_ops`; on a GPU stream they run `mx.fast`).

    Returns:
        The runtime; its head is None when the folder has no MTP weights.

    Raises:
        FileNotFoundError / NotADirectoryError: missing folder, config or weights.
        CheckpointError (a ValueError): unknown model_type or head layout,
            bad config fields, unreadable files, mismatching weights.
    """
    path = Path(path)
    config = read_config(path)
    where = str(path / "config.json")
    check_config(config, where)
    weights = read_weights(path)
    tokenizer = read_tokenizer(path)
    runtime = build_runtime(config, weights, tokenizer, where=where)
    del weights  # packing replaces each weight: the file's copies must not outlive their modules
    if fuse_cpu_ops:
        runtime.fuse_cpu_ops()
    return runtime


