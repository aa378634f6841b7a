"""Small random models of each supported family, for tests and examples.

`init_random(model_type)` builds a float32 model from `SMALL_CONFIGS` (sizes
that run fast on two CPU cores) with the family's own MTP head layout; its
output projections are re-drawn with a spread that keeps random greedy
decoding from collapsing onto one token.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext import models
from mtplx_ext._checks import SEED_LIMIT, as_int
from mtplx_ext.checkpoints import quantize as quant
from mtplx_ext.checkpoints.loading import FAMILY_LAYOUT, build_runtime
from mtplx_ext.models import trunk as trunk_lib
from mtplx_ext.models.base import materialize
from mtplx_ext.models.runtime import MTPRuntime



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


def _spread_init(runtime: MTPRuntime, std: float) -> None:
    """Re-draws embedding and output projection so logits have useful spread."""
    emb = runtime.trunk.model.embed_tokens
    emb.weight = mx.random.normal(emb.weight.shape, scale=std)
    lm = trunk_lib.text_model(runtime.trunk)
    if "lm_head" in lm:
        lm.lm_head.weight = mx.random.normal(lm.lm_head.weight.shape, scale=std)
    for head in runtime.mtp_modules:
        if "shared_head" in head:
            head.shared_head.head.weight = mx.random.normal(head.shared_head.head.weight.shape, scale=std)


def init_random(
    model_type: str,
    seed: int = 0,
    *,
    head_layout: str | None | object = FAMILY_LAYOUT,
    fuse_cpu_ops: bool = False,
    quantize: dict | None = None,
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
        quantize: quantize trunk and head as `convert -q` does, e.g.
            {"bits": 4, "group_size": 32}; also "mtp_bits" (None: float
            head) and "keep_fusion_float" (see `quantize.quantize_runtime`).
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
    if head_layout is FAMILY_LAYOUT:
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
    materialize(runtime)
    if quantize is not None:
        quant.quantize_runtime(runtime, **quantize)
    if fuse_cpu_ops:
        runtime.fuse_cpu_ops()
    return runtime


__all__ = ["SMALL_CONFIGS", "init_random"]
