"""Folders saved by transformers 5 (RoPE settings only in `rope_parameters`) load with transformers' RoPE.

transformers itself is the oracle: a small random model of each family is
built and saved by transformers, loaded here, and its trunk logits must equal
transformers' forward within float32 rounding. The same folder with the
mapping undone (mlx-lm's defaults) must miss by far more, so the comparison
can fail.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.checkpoints import rope

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: Largest |logit difference| allowed between transformers and this package
#: (float32 sums in other orders, the max over 2 x 80 x 128 logits; 2.01e-5
#: was seen once against a former 2e-5). The unmapped folder must stay off
#: by more than `OFF` (2e-3, where it has always been far beyond).
TOL = 5e-5
OFF = 2e-3


def _deepseek(rng):
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=512, initializer_range=0.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": float(rng.uniform(500, 5000)), "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    return transformers.DeepseekV3ForCausalLM(cfg)


def _glm(rng):
    cfg = transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, initializer_range=0.2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": float(rng.uniform(500, 5000)),
                         "partial_rotary_factor": 0.5},
    )
    return transformers.Glm4MoeForCausalLM(cfg)


def _qwen3(rng):
    cfg = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.2, max_position_embeddings=512,
        rope_parameters={"rope_type": "linear", "rope_theta": float(rng.uniform(500, 5000)), "factor": 2.0},
    )
    return transformers.Qwen3ForCausalLM(cfg)


def _saved(make, rng, tmp_path):
    torch.manual_seed(int(rng.integers(2**31)))
    model = make(rng).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    assert "rope_parameters" in json.loads((folder / "config.json").read_text())
    return model, folder


def _max_error(model, folder, tokens) -> float:
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.float().numpy()
    got = np.array(mtplx_ext.load(folder).trunk(mx.array(tokens)))
    return float(np.abs(got - want).max())


@pytest.mark.parametrize("make", [_deepseek, _glm, _qwen3], ids=["deepseek_v3-yarn", "glm4_moe-partial", "qwen3-linear"])
def test_a_transformers_5_folder_gives_transformers_logits(make, rng, tmp_path):
    model, folder = _saved(make, rng, tmp_path)
    tokens = rng.integers(0, 128, (2, 80))  # past original_max_position_embeddings: YaRN matters
    assert _max_error(model, folder, tokens) < TOL
    # The same folder read with mlx-lm's defaults (no mapping) is off: the check can fail.
    undone = tmp_path / "undone"
    shutil.copytree(folder, undone)
    cfg = json.loads((undone / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = 10000.0 if rp["rope_theta"] != 10000.0 else 20000.0
    cfg["rope_scaling"] = None
    if "partial_rotary_factor" in rp:
        cfg["partial_rotary_factor"] = 1.0
    (undone / "config.json").write_text(json.dumps(cfg))
    assert _max_error(model, undone, tokens) > OFF


def test_an_unsupported_or_contradicting_rope_setting_is_refused_in_one_line(tmp_path):
    with pytest.raises(mtplx_ext.CheckpointError, match=r"rope_parameters.rope_type 'wavy' is not supported"):
        rope.map_rope_parameters({"rope_parameters": {"rope_type": "wavy", "rope_theta": 1.0}})
    with pytest.raises(mtplx_ext.CheckpointError, match=r"rope_theta = 5.0 contradicts rope_parameters.rope_theta = 7.0"):
        rope.map_rope_parameters({"rope_theta": 5.0, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    cfg = rope.map_rope_parameters({"text_config": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 3.0, "factor": 2.0}}})
    assert cfg["text_config"]["rope_theta"] == 3.0 and cfg["text_config"]["rope_scaling"]["factor"] == 2.0
