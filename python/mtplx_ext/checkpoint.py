"""Loading, saving and randomly initialising MTP runtimes.

A model folder is Hugging Face-style: config.json, one or more
*.safetensors files and, optionally, tokenizer.json. The trunk is stored
as mlx-lm stores it (so `mlx_lm.utils.load_model(path, strict=False)` reads
it); the head under its layout's checkpoint names and conventions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mtplx_ext import models
from mtplx_ext._checks import SEED_LIMIT, as_int
from mtplx_ext.models import trunk as trunk_lib
from mtplx_ext.models.base import take_prefixed
from mtplx_ext.runtime import MTPRuntime

_DEFAULT = object()

# Small configs for tests: fast on two CPU cores, float32.
_SMALL_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

SMALL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {**_SMALL_COMMON, "num_hidden_layers": 2, "head_dim": 16},
    "qwen3_next": {
        **_SMALL_COMMON,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "partial_rotary_factor": 0.5,
        "num_experts": 0,
        "num_experts_per_tok": 1,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "deepseek_v3": {
        **_SMALL_COMMON,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    },
    "qwen3_5": {
        **_SMALL_COMMON,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "num_experts_per_tok": 1,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 32,
        "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    "glm4_moe": {
        **_SMALL_COMMON,
        "num_hidden_layers": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "rope_scaling": None,
    },
    "mimo": {**_SMALL_COMMON, "num_hidden_layers": 2, "num_nextn_predict_layers": 1},
}


def _read_config(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"model path {str(path)!r} is not a folder")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{cfg} has no model_type field")
    return config


def build_runtime(
    config: dict,
    weights: dict[str, mx.array] | None = None,
    tokenizer: Any = None,
) -> MTPRuntime:
    """Builds the trunk and head a config describes, optionally loading weights.

    Args:
        config: full config; `mtp_head_layout` picks the head (detected from
            the weight names when absent; None or "none" for no head).
        weights: checkpoint tensors under checkpoint names, or None to keep
            the random initialisation.
        tokenizer: attached to the runtime as is.

    Returns:
        The runtime, parameters evaluated.
    """
    if config.get("quantization") or config.get("quantization_config"):
        raise NotImplementedError("quantized checkpoints are not supported yet")
    arch = trunk_lib.trunk_module(config["model_type"])
    trunk = arch.Model(arch.ModelArgs.from_dict(config))
    layout = config.get("mtp_head_layout", _DEFAULT)
    if layout is _DEFAULT:
        layout = models.detect_layout(weights or {}, config)
    if layout in (None, "none"):
        head = None
    else:
        mod = models.layout_module(layout)
        head = mod.Model(mod.ModelArgs.from_config(config), trunk)
    if weights is not None:
        weights = dict(weights)
        if head is not None:
            head_w = head.sanitize(take_prefixed(weights, head.prefix))
            head.load_weights(list(head_w.items()), strict=True)
        if hasattr(trunk, "sanitize"):
            weights = trunk.sanitize(weights)
        trunk.load_weights(list(weights.items()), strict=True)
    config = {**config, "mtp_head_layout": layout if head is not None else None}
    if head is not None:
        config["mtp_hidden_source"] = head.args.hidden_source
    runtime = MTPRuntime(trunk, head, config, tokenizer)
    mx.eval(runtime.parameters())
    return runtime


def load(path: str | Path, *, fuse_cpu_ops: bool = True) -> MTPRuntime:
    """Loads a Hugging Face-style model folder into an MTP runtime.

    Args:
        path: folder with config.json, *.safetensors and optionally
            tokenizer.json.
        fuse_cpu_ops: swap RMSNorm / RoPE modules for single-node fused ones
            and route attention through the fused op while decoding
            (`MTPRuntime.fuse_cpu_ops`; on a GPU stream they run `mx.fast`).

    Returns:
        The runtime; its head is None when the folder has no MTP weights.

    Raises:
        FileNotFoundError / NotADirectoryError: missing folder, config or weights.
        ValueError: unknown model_type or head layout, mismatching weights.
    """
    path = Path(path)
    config = _read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {str(path)!r} has no *.safetensors files")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    runtime = build_runtime(config, weights, tokenizer)
    if fuse_cpu_ops:
        runtime.fuse_cpu_ops()
    return runtime


def save_runtime(runtime: MTPRuntime, path: str | Path) -> None:
    """Writes config.json, model.safetensors and tokenizer.json (if any).

    Raises:
        FileExistsError: if the folder already holds other *.safetensors
            files, which `load` would merge in.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    stale = [f.name for f in path.glob("*.safetensors") if f.name != "model.safetensors"]
    if stale:
        raise FileExistsError(f"{str(path)!r} already holds other weight files: {stale}")
    weights = dict(tree_flatten(runtime.trunk.parameters()))
    if runtime.head is not None:
        weights.update(runtime.head.checkpoint_weights())
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = dict(runtime.config)
    config["mtp_head_layout"] = runtime.head_layout
    if runtime.head is not None:
        config["mtp_hidden_source"] = runtime.hidden_source
    else:
        config.pop("mtp_hidden_source", None)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if runtime.tokenizer is not None:
        runtime.tokenizer.save(str(path / "tokenizer.json"))


def _spread_init(runtime: MTPRuntime, std: float) -> None:
    """Re-draws embedding and output projection so logits have useful spread."""
    emb = runtime.trunk.model.embed_tokens
    emb.weight = mx.random.normal(emb.weight.shape, scale=std)
    lm = trunk_lib.text_model(runtime.trunk)
    if "lm_head" in lm:
        lm.lm_head.weight = mx.random.normal(lm.lm_head.weight.shape, scale=std)
    head = runtime.head
    if head is not None and "shared_head" in head:
        head.shared_head.head.weight = mx.random.normal(head.shared_head.head.weight.shape, scale=std)


def init_random(
    model_type: str,
    seed: int = 0,
    *,
    head_layout: str | None | object = _DEFAULT,
    fuse_cpu_ops: bool = False,
    **config_overrides: Any,
) -> MTPRuntime:
    """Makes a small random model of a family, float32, fast on a CPU.

    Args:
        model_type: one of `SMALL_CONFIGS` ("qwen3", "qwen3_next", "qwen3_5",
            "deepseek_v3", "glm4_moe", "mimo").
        seed: seeds MLX's global random generator before initialisation.
        head_layout: "qwen3_next", "deepseek", "mimo", or None for no MTP
            head; defaults to the family's own layout.
        fuse_cpu_ops: as in `load` (off by default here, so that random
            test models are exactly mlx-lm's modules).
        **config_overrides: any config field (hidden_size, vocab_size, ...).

    Returns:
        The runtime (no tokenizer).

    Raises:
        ValueError: unknown model_type or head_layout, or a seed outside [0, 2**64).
        TypeError: a seed that is not an int.
    """
    if model_type not in SMALL_CONFIGS:
        raise ValueError(
            f"unknown model_type {model_type!r} for init_random; supported: {', '.join(SMALL_CONFIGS)}"
        )
    if head_layout is _DEFAULT:
        head_layout = models.FAMILY_DEFAULT_LAYOUT.get(model_type, "qwen3_next")
    if head_layout is not None:
        models.layout_module(head_layout)
    # NumPy scalars as Python numbers: the config is saved as JSON.
    overrides = {k: v.item() if isinstance(v, np.generic) else v for k, v in config_overrides.items()}
    config = {**SMALL_CONFIGS[model_type], **overrides, "model_type": model_type}
    config["mtp_head_layout"] = head_layout
    mx.random.seed(as_int("seed", seed, 0, SEED_LIMIT))
    runtime = build_runtime(config)
    # Unit-variance rows give logits with a spread of several nats on
    # RMS-normed hidden states, so random greedy decoding does not collapse.
    hidden = int(trunk_lib.text_config(config)["hidden_size"])
    _spread_init(runtime, std=1.0 / math.sqrt(max(1, hidden // 16)))
    mx.eval(runtime.parameters())
    if fuse_cpu_ops:
        runtime.fuse_cpu_ops()
    return runtime
