"""Tiny synthetic Hugging Face checkpoints in the published MTP layouts.

No real weights can be downloaded, so each fixture is written the way the
published checkpoint is: its key names, the structure of its shapes, the
config fields that announce the head, sharded safetensors with
`model.safetensors.index.json` (the head in the last shard) and a
tokenizer. The trunk's tensors come from mlx-lm's own model of the family
(random values), renamed back to the Hugging Face names that the family's
mlx-lm `sanitize` reads; the head's own tensors are the key lists below.

Sources each head key list was checked against (module and parameter
names, concatenation order, norm convention):

- Qwen3-Next: vLLM `vllm/model_executor/models/qwen3_next_mtp.py`
  (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.{i}`, `norm`,
  GemmaRMSNorm i.e. zero-centred, fc(cat[embedding, hidden])); the MTP layer
  is a Qwen3-Next MoE decoder layer (`mlp.gate`, `mlp.experts.N.*`,
  `mlp.shared_expert.*`, `mlp.shared_expert_gate`). Count in
  `num_nextn_predict_layers`. mlx-lm `qwen3_next.py` sanitize drops `mtp.`.
- Qwen3.5 / 3.6: vLLM `qwen3_5_mtp.py`: `mtp.*` at the top level next to the
  multimodal text model `model.language_model.*` (vision tensors
  `model.visual.*` ignored); `mtp_num_hidden_layers` in `text_config`. The
  dense head of Qwen3.5-0.8B has 15 `mtp.*` tensors. MoE variants store the
  experts fused (`experts.gate_up_proj`, `experts.down_proj`; mlx-lm
  `qwen3_5_moe.py`).
- DeepSeek-V3 / R1: vLLM `deepseek_mtp.py`: `model.layers.{N}.{enorm, hnorm,
  eh_proj, embed_tokens, shared_head.norm, shared_head.head}` plus a
  DeepSeek decoder block (MLA `kv_b_proj`, per-expert MoE) at N =
  num_hidden_layers (61 in the published model), eh_proj(cat[enorm(emb),
  hnorm(hidden)]); `num_nextn_predict_layers`.
- GLM-4.5: vLLM `glm4_moe_mtp.py`: as DeepSeek at `model.layers.{N}`.
- MiMo-7B: vLLM `mimo_mtp.py`: `model.mtp_layers.{i}.{token_layernorm,
  hidden_layernorm, input_proj, final_layernorm}` plus a Qwen2 block,
  input_proj(cat[hidden, embedding]); `num_nextn_predict_layers`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from safetensors.numpy import save_file

from mtplx_ext import checkpoints as checkpoint

# The trunk shapes are mtplx_ext's own small configs; what is added here is
# what a published config.json carries besides them (architectures, the head
# count, MoE experts for the Qwen3-Next head's MoE layer, the HF rope keys).
_SMALL = checkpoint.SMALL_CONFIGS


def _hf(family: str, architecture: str, **fields) -> dict:
    return {
        **_SMALL[family],
        "torch_dtype": "float32",
        "architectures": [architecture],
        "model_type": family,
        **fields,
    }


_QWEN3_NEXT = _hf(
    "qwen3_next", "Qwen3NextForCausalLM", num_experts=4, num_experts_per_tok=2, num_nextn_predict_layers=1
)

_QWEN3_5_TEXT = {
    k: v
    for k, v in _hf(
        "qwen3_5",
        "Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5_text",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        mtp_num_hidden_layers=1,
    ).items()
    # A dense Qwen3.5 text config has no MoE fields.
    if k not in ("architectures", "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size",
                 "moe_intermediate_size")
}

_DEEPSEEK = _hf("deepseek_v3", "DeepseekV3ForCausalLM", num_nextn_predict_layers=1)

CONFIGS: dict[str, dict] = {
    "qwen3_next": _QWEN3_NEXT,
    "qwen3_5": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": _QWEN3_5_TEXT,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16},
    },
    "qwen3_5_moe": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            **_QWEN3_5_TEXT,
            "model_type": "qwen3_5_moe_text",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 64,
            "moe_intermediate_size": 32,
        },
        "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 16},
    },
    "deepseek_v3": _DEEPSEEK,
    "glm4_moe": _hf("glm4_moe", "Glm4MoeForCausalLM", num_nextn_predict_layers=1),
    "mimo": _hf("mimo", "MiMoForCausalLM", num_nextn_predict_layers=1),
}

#: family -> MTP layout name in mtplx_ext.
LAYOUT = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",
    "deepseek_v3": "deepseek",
    "glm4_moe": "deepseek",
    "mimo": "mimo",
}

#: The head's own tensors (besides its decoder block): name -> shape in (H, V) units.
HEAD_OWN: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen3_next": {
        "mtp.fc.weight": ("H", "2H"),
        "mtp.pre_fc_norm_embedding.weight": ("H",),
        "mtp.pre_fc_norm_hidden.weight": ("H",),
        "mtp.norm.weight": ("H",),
    },
    "deepseek": {
        "model.layers.{N}.enorm.weight": ("H",),
        "model.layers.{N}.hnorm.weight": ("H",),
        "model.layers.{N}.eh_proj.weight": ("H", "2H"),
        "model.layers.{N}.embed_tokens.weight": ("V", "H"),
        "model.layers.{N}.shared_head.norm.weight": ("H",),
        "model.layers.{N}.shared_head.head.weight": ("V", "H"),
    },
    "mimo": {
        "model.mtp_layers.0.token_layernorm.weight": ("H",),
        "model.mtp_layers.0.hidden_layernorm.weight": ("H",),
        "model.mtp_layers.0.input_proj.weight": ("H", "2H"),
        "model.mtp_layers.0.final_layernorm.weight": ("H",),
    },
}

#: Where the head's decoder block sits, and which trunk layer's (HF) keys it copies:
#: a full-attention layer (MoE where the family's later layers are).
BLOCK = {
    "qwen3_next": ("mtp.layers.0.", "model.layers.1."),
    "qwen3_5": ("mtp.layers.0.", "model.language_model.layers.1."),
    "qwen3_5_moe": ("mtp.layers.0.", "model.language_model.layers.1."),
    "deepseek_v3": ("model.layers.{N}.", "model.layers.1."),
    "glm4_moe": ("model.layers.{N}.", "model.layers.1."),
    "mimo": ("model.mtp_layers.0.", "model.layers.0."),
}

#: Families whose published norms are zero-centred (the model scales by 1 + w).
ZERO_CENTRED = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
_ZC_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".norm.weight",
             ".q_norm.weight", ".k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def text(config: dict) -> dict:
    return {**config, **config["text_config"]} if "text_config" in config else config


def is_norm(key: str) -> bool:
    return "norm" in key.rsplit(".", 2)[-2] and key.endswith(".weight")


def zero_centred(key: str, family: str) -> bool:
    """Whether a published tensor is a zero-centred norm weight."""
    if family not in ZERO_CENTRED or "linear_attn.norm" in key:
        return False
    return any(key.endswith(s) for s in _ZC_NORMS) or key == "model.language_model.norm.weight"


def _mlx_lm_params(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random parameters of mlx-lm's own model of the family, under mlx-lm's names."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    out = {}
    for k, v in tree_flatten(model.parameters()):
        a = rng.normal(size=v.shape) * 0.2
        if v.ndim == 1 and "norm" in k:
            a = a + 1.0
        out[k] = a.astype(np.float32)
    return out


def _unstack(w: dict, key: str, fmt: str) -> None:
    stacked = w.pop(key)
    for e, part in enumerate(stacked):
        w[fmt.format(e=e)] = np.ascontiguousarray(part)


def _to_hf(family: str, config: dict, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """mlx-lm names and conventions -> the published checkpoint's."""
    t = text(config)
    out: dict[str, np.ndarray] = {}
    for k, v in w.items():
        if family.startswith("qwen3_5"):
            k = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
        if "conv1d.weight" in k:
            v = np.ascontiguousarray(np.swapaxes(v, 1, 2))  # [C, K, 1] -> HF's [C, 1, K]
        out[k] = v
    for k in [k for k in out if ".switch_mlp." in k]:
        pre, rest = k.split(".switch_mlp.")
        proj = rest.split(".")[0]
        if family == "qwen3_5_moe":
            continue
        _unstack(out, k, f"{pre}.experts.{{e}}.{proj}.weight")
    if family == "qwen3_5_moe":
        for k in [k for k in out if ".switch_mlp.gate_proj." in k]:
            pre = k.split(".switch_mlp.")[0]
            gate, up = out.pop(k), out.pop(f"{pre}.switch_mlp.up_proj.weight")
            out[f"{pre}.experts.gate_up_proj"] = np.concatenate([gate, up], axis=-2)
            out[f"{pre}.experts.down_proj"] = out.pop(f"{pre}.switch_mlp.down_proj.weight")
    if family == "deepseek_v3":
        heads = t["num_attention_heads"]
        for k in [k for k in out if k.endswith("self_attn.embed_q.weight")]:
            pre = k[: -len("embed_q.weight")]
            wk, wv = out.pop(k), out.pop(pre + "unembed_out.weight")
            kv_b = np.concatenate([wk.transpose(0, 2, 1), wv], axis=1).reshape(heads * (wk.shape[2] + wv.shape[1]), -1)
            out[pre + "kv_b_proj.weight"] = np.ascontiguousarray(kv_b)
    for k in out:
        if zero_centred(k, family):
            out[k] = out[k] - np.float32(1.0)
    return out


def head_tensors(family: str, config: dict, trunk_hf: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The published head: its own tensors plus a copy-structured decoder block (fresh values)."""
    t = text(config)
    n, h, v = t["num_hidden_layers"], t["hidden_size"], t["vocab_size"]
    dims = {"H": h, "2H": 2 * h, "V": v}
    zc = family in ZERO_CENTRED
    out = {}
    for key, shape in HEAD_OWN[LAYOUT[family]].items():
        key = key.format(N=n)
        a = rng.normal(size=tuple(dims[d] for d in shape)) * 0.2
        if is_norm(key) and not zc:
            a = a + 1.0
        out[key] = a.astype(np.float32)
    dst, src = (p.format(N=n) for p in BLOCK[family])
    for k, a in trunk_hf.items():
        if k.startswith(src):
            b = rng.normal(size=a.shape) * 0.2
            if a.ndim == 1 and "norm" in k and not zero_centred(k, family) and "linear" not in k:
                b = b + 1.0
            out[dst + k[len(src):]] = b.astype(a.dtype)
    return out


def write_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def write_checkpoint(folder: Path, family: str, seed: int, shards: int = 3, extra: dict | None = None) -> dict:
    """Writes a published-layout checkpoint; returns all its tensors by name.

    The trunk spreads over `shards - 1` shards, the head goes to the last
    one with the final norm (as DeepSeek-V3 stores layer 61 in its last shard).
    """
    rng = np.random.default_rng(seed)
    config = json.loads(json.dumps(CONFIGS[family]))
    folder.mkdir(parents=True, exist_ok=True)
    trunk = _to_hf(family, config, _mlx_lm_params(config, rng))
    head = head_tensors(family, config, trunk, rng)
    if family.startswith("qwen3_5"):
        trunk["model.visual.patch_embed.proj.weight"] = rng.normal(size=(16, 3, 2, 2)).astype(np.float32)
    keys = sorted(trunk)
    parts = [dict() for _ in range(shards)]
    for i, k in enumerate(keys):
        parts[min(i * (shards - 1) // len(keys), shards - 2)][k] = trunk[k]
    parts[-1].update(head)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    wm = {}
    for name, part in zip(names, parts):
        save_file(part, folder / name, metadata={"format": "pt"})
        wm.update({k: name for k in part})
    total = sum(a.nbytes for p in parts for a in p.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}, indent=2)
    )
    (folder / "config.json").write_text(json.dumps({**config, **(extra or {})}, indent=2))
    write_tokenizer(folder, text(config)["vocab_size"])
    return {**trunk, **head}


def head_keys(family: str, tensors: dict) -> set[str]:
    n = text(CONFIGS[family])["num_hidden_layers"]
    prefix = {"qwen3_next": "mtp.", "deepseek": f"model.layers.{n}.", "mimo": "model.mtp_layers."}[LAYOUT[family]]
    return {k for k in tensors if k.startswith(prefix)}


def _retag_fp8(file: Path) -> None:
    """Marks the uint8 fp8 tensors of a safetensors file F8_E4M3, as the published files store them."""
    import struct

    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    for k, v in header.items():
        if k != "__metadata__" and v["dtype"] == "U8":
            v["dtype"] = "F8_E4M3"
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    file.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])


def block_fp8(folder: Path, block: int = 128) -> dict[str, np.ndarray]:
    """Rewrites a DeepSeek fixture's linear weights as block-fp8 (DeepSeek-V3's published form).

    Each `*_proj.weight` of a decoder layer (head included) becomes an
    F8_E4M3 tensor plus a float32 `weight_scale_inv` per 128 x 128 block, and
    config.json gets `quantization_config`. Returns the dequantized weights
    every reader should see, by name.
    """
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    wm = index["weight_map"]
    expect = {}
    for shard in sorted(set(wm.values())):
        from safetensors.numpy import load_file

        t = load_file(folder / shard)
        for k in [k for k in t if k.startswith("model.layers.") and k.endswith("_proj.weight") and t[k].ndim == 2]:
            w = t[k]
            m, n = w.shape
            pm, pn = -m % block, -n % block
            blocks = np.pad(w, ((0, pm), (0, pn))).reshape((m + pm) // block, block, (n + pn) // block, block)
            scale = (np.abs(blocks).max(axis=(1, 3)) / 448.0).astype(np.float32)
            scaled = (blocks / scale[:, None, :, None]).reshape(m + pm, n + pn)[:m, :n]
            q = mx.to_fp8(mx.array(scaled.astype(np.float32)))
            t[k] = np.array(q)
            t[k[: -len("weight")] + "weight_scale_inv"] = scale
            wm[k[: -len("weight")] + "weight_scale_inv"] = shard
            deq = np.array(mx.from_fp8(q, dtype=mx.float32)).astype(np.float64)
            full = np.pad(deq, ((0, pm), (0, pn))).reshape(blocks.shape) * scale[:, None, :, None]
            expect[k] = full.reshape(m + pm, n + pn)[:m, :n]
        save_file(t, folder / shard, metadata={"format": "pt"})
        _retag_fp8(folder / shard)
    index_file.write_text(json.dumps({**index, "weight_map": dict(sorted(wm.items()))}, indent=2))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return expect
