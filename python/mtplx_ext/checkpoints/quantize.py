"""Quantized trunks and heads through mlx-lm's own quantization.

A quantized folder is what mlx-lm writes: `quantization` in config.json
holds the default {group_size, bits, mode} and per-layer overrides keyed by
module path (a dict, or false for a layer kept in float). The trunk is
quantized exactly as `mlx_lm.utils.load_model` / `quantize_model` do it. The
head's layers are keyed by their checkpoint names (`mtp.fc`,
`model.layers.61.eh_proj`, ...), which no trunk module path can equal, so
mlx-lm reading the same config ignores them.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import infer_quant_config, quantize_model

from mtplx_ext._checks import CheckpointError

#: Modes mlx-lm's `quantize_model` knows, with its default (group_size, bits).
MODES = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}

_QUANT_KEYS = ("group_size", "bits", "mode")


def check_quantization(q: Any, where: str) -> dict:
    """Validates a `quantization` entry; returns {group_size, bits, mode}.

    MLX itself decides which (bits, group_size) pairs a mode accepts: a tiny
    `mx.quantize` call probes it, so no table here can drift from MLX's.

    Raises:
        CheckpointError (a ValueError): one line naming `where` and the bad field.
    """
    if not isinstance(q, dict):
        raise CheckpointError(f"{where} must be an object with group_size, bits and mode, got {q!r}")
    mode = q.get("mode", "affine")
    if mode not in MODES:
        raise CheckpointError(f"{where}: quantization mode {mode!r} is not one mlx-lm has ({', '.join(MODES)})")
    gs, bits = q.get("group_size", MODES[mode][0]), q.get("bits", MODES[mode][1])
    for name, v in (("group_size", gs), ("bits", bits)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CheckpointError(f"{where}: {name} must be a positive integer, got {v!r}")
    try:
        mx.eval(mx.quantize(mx.zeros((1, gs)), group_size=gs, bits=bits, mode=mode))
    except (ValueError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{where}: bits={bits}, group_size={gs} not supported by mode {mode!r}: {msg}") from None
    return {"group_size": gs, "bits": bits, "mode": mode}


def check_config_quantization(config: dict, where: str) -> dict | None:
    """The validated `quantization` of a config (default and overrides), or None."""
    q = config.get("quantization")
    if q is None:
        return None
    check_quantization({k: q[k] for k in _QUANT_KEYS if k in q} if isinstance(q, dict) else q, f"{where} quantization")
    for path, v in q.items():
        if path in _QUANT_KEYS or isinstance(v, bool):
            continue
        check_quantization(v, f"{where} quantization[{path!r}]")
    return q


def quantize_for_load(
    module: nn.Module,
    quantization: dict,
    weights: dict[str, mx.array],
    name_of: Callable[[str], str] = lambda p: p,
) -> None:
    """Turns the layers of `module` that `weights` holds quantized into mlx-lm's quantized modules.

    The rule of `mlx_lm.utils.load_model`: a per-layer entry of the config
    wins; otherwise a layer is quantized when its `scales` are stored, with
    the group size, bits and mode its tensors were packed with.

    Args:
        module: unquantized model (trunk or head).
        quantization: the config's `quantization`.
        weights: the tensors about to be loaded, under module-relative names.
        name_of: module path -> the key of its per-layer entry (the head's
            checkpoint name; the trunk's own path).
    """

    def predicate(path: str, m: nn.Module):
        key = name_of(path)
        if key in quantization:
            return quantization[key]
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, m, weights)

    nn.quantize(
        module,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def quantize_trunk(trunk: nn.Module, config: dict, bits: int, group_size: int, mode: str = "affine") -> dict:
    """Quantizes a trunk in place with `mlx_lm.utils.quantize_model`.

    Returns:
        The config with mlx-lm's `quantization` / `quantization_config`
        (the family's own per-layer choices, e.g. 8-bit MoE gates, included).
    """
    check_quantization({"group_size": group_size, "bits": bits, "mode": mode}, "trunk quantization")
    # quantize_model prints its bits-per-weight line; callers report their own.
    with contextlib.redirect_stdout(io.StringIO()):
        _, qconfig = quantize_model(trunk, config, group_size, bits, mode=mode)
    return qconfig


def quantize_head(
    head: nn.Module,
    trunk: nn.Module,
    quantization: dict,
    bits: int | None,
    group_size: int,
    mode: str = "affine",
    keep_float: Callable[[str], bool] = lambda name: False,
) -> dict:
    """Quantizes the head's layers in place and records each under its checkpoint name.

    Args:
        head: the (float) MTP head.
        trunk: its trunk; the family's `quant_predicate` (8-bit MoE gates)
            applies to the head's layer as to the trunk's.
        quantization: the config's `quantization`, updated in place.
        bits: head bits, or None to keep the whole head in float.
        group_size, mode: as for the trunk.
        keep_float: checkpoint name of a layer -> keep it in float.

    Returns:
        `quantization` with one entry per head layer that could be
        quantized (a dict, or False where it stays in float).
    """
    family_rule = getattr(trunk, "quant_predicate", None)
    if bits is not None:
        check_quantization({"group_size": group_size, "bits": bits, "mode": mode}, "--mtp-bits")
    params = {"group_size": group_size, "bits": bits, "mode": mode}

    def predicate(path: str, m: nn.Module):
        if not hasattr(m, "to_quantized") or isinstance(m, nn.Embedding):
            return False
        name = head.to_checkpoint_name(path + ".weight")[: -len(".weight")]
        choice: Any = dict(params)
        if bits is None or keep_float(name) or m.weight.shape[-1] % group_size != 0:
            choice = False
        elif family_rule is not None:
            rule = family_rule(name, m)
            choice = rule if isinstance(rule, dict) else (choice if rule else False)
        quantization[name] = choice
        return choice

    nn.quantize(head, group_size=group_size, bits=bits or 4, mode=mode, class_predicate=predicate)
    return quantization


def quantize_runtime(
    runtime: Any,
    bits: int,
    group_size: int = 64,
    mode: str = "affine",
    mtp_bits: int | None | object = ...,
    keep_fusion_float: bool = False,
) -> dict:
    """Quantizes a float runtime's trunk and head in place, as `convert -q` does.

    Args:
        runtime: an `MTPRuntime` with float weights.
        bits, group_size, mode: the trunk's quantization (mlx-lm's).
        mtp_bits: the head's bits; default the trunk's, None keeps the head
            in float.
        keep_fusion_float: keep the head's [H, 2H] fusion projection (`fc`,
            `eh_proj`, `input_proj`) in float.

    Returns:
        The new config (also set on the runtime), with `quantization`.
    """
    config = quantize_trunk(runtime.trunk, runtime.config, bits, group_size, mode)
    q = config["quantization"]
    hb = bits if mtp_bits is ... else mtp_bits
    for head in runtime.mtp_modules:
        fusion = head.to_checkpoint_name(head.fusion_module + ".weight")[: -len(".weight")]
        quantize_head(
            head, runtime.trunk, q, hb, group_size, mode, lambda n, f=fusion: keep_fusion_float and n == f
        )
    config["quantization_config"] = q
    object.__setattr__(runtime, "_config", config)
    mx.eval(runtime.parameters())
    return config
