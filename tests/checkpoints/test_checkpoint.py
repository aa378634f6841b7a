"""load / save / init_random: bit-exact round trips, stored conventions, mlx-lm reads the trunk."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import load_model
from safetensors.numpy import load_file, save_file

import mtplx_ext
from mtplx_ext.models.packed_linear import linears_unpacked
import _seed

CASES = [
    ("qwen3", "qwen3_next"),
    ("qwen3_next", "qwen3_next"),
    ("qwen3_5", "qwen3_next"),
    ("deepseek_v3", "deepseek"),
    ("mimo", "mimo"),
    ("glm4_moe", "deepseek"),
    ("qwen3", "deepseek"),
    ("qwen3", "mimo"),
]
IDS = [f"{f}-{h}" for f, h in CASES]

# Head RMSNorm weights under checkpoint names, written out per layout
# (n = num_hidden_layers), independent of the code under test.
_ATTN_NORMS = ("input_layernorm", "post_attention_layernorm")


def head_norm_keys(layout: str, family: str, n: int) -> set[str]:
    qk_families = ("qwen3", "qwen3_next", "qwen3_5", "glm4_moe")
    qk = ("self_attn.q_norm", "self_attn.k_norm") if family in qk_families else ()
    if family == "deepseek_v3":
        qk = ("self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")
    block = [f"{m}.weight" for m in (*_ATTN_NORMS, *qk)]
    if layout == "qwen3_next":
        own = ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"]
        return {f"mtp.{m}.weight" for m in own} | {f"mtp.layers.0.{b}" for b in block}
    if layout == "deepseek":
        own = ["enorm", "hnorm", "shared_head.norm"]
        return {f"model.layers.{n}.{m}.weight" for m in own} | {f"model.layers.{n}.{b}" for b in block}
    own = ["token_layernorm", "hidden_layernorm", "final_layernorm"]
    return {f"model.mtp_layers.0.{m}.weight" for m in own} | {f"model.mtp_layers.0.{b}" for b in block}


def head_prefix(layout: str, n: int) -> str:
    return {"qwen3_next": "mtp.", "deepseek": f"model.layers.{n}.", "mimo": "model.mtp_layers.0."}[layout]


@pytest.fixture(scope="module")
def seed() -> int:
    s = _seed.fresh()
    print(f"random seed {s}")
    return s


def randomized(family: str, layout: str | None, seed: int, **overrides) -> mtplx_ext.MTPRuntime:
    """A small runtime whose every parameter is freshly random (norms near 1)."""
    rt = mtplx_ext.init_random(family, seed=seed, head_layout=layout, **overrides)
    rng = np.random.default_rng(seed)
    new = []
    for k, v in tree_flatten(rt.parameters()):
        a = rng.normal(size=v.shape) * 0.2 + (1.0 if "norm" in k.split(".")[-2] else 0.0)
        new.append((k, mx.array(a, dtype=v.dtype)))
    rt.update(tree_unflatten(new))
    mx.eval(rt.parameters())
    return rt


def _rms64(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def head_norm_modules(rt) -> dict[str, object]:
    """Checkpoint key of each head norm weight -> the norm module using it."""
    out = {}
    for name, m in rt.head.named_modules():
        if name and "norm" in name.split(".")[-1] and "weight" in m and m.weight.ndim == 1:
            out[rt.head.to_checkpoint_name(f"{name}.weight")] = m
    return out


def check_norm_scales(rt, stored: dict[str, np.ndarray], keys: set[str], offset: float, seed: int):
    """Each head norm computes rms(x) * (offset + stored weight), float64 reference."""
    mods = head_norm_modules(rt)
    assert set(mods) == keys
    x = np.random.default_rng(seed).normal(size=(3, rt.config["hidden_size"]))
    for k, m in mods.items():
        xk = x[:, : stored[k].shape[0]]
        got = np.array(m(mx.array(xk, dtype=mx.float32)), dtype=np.float64)
        ref = _rms64(xk, offset + stored[k].astype(np.float64), m.eps)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=k)


def saved(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor `save` wrote (trunk file and head file)."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def params_np(rt) -> dict[str, np.ndarray]:
    """Parameters as the files hold them: packed Linear layers (`load` packs them) unpacked."""
    with linears_unpacked(rt):
        return {k: np.array(v) for k, v in tree_flatten(rt.parameters())}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_save_load_round_trip_is_bit_exact(tmp_path, seed, case):
    rt = randomized(*case, seed)
    rt.save(tmp_path)
    # Unfused, so that the same modules run the same float operations.
    back = mtplx_ext.load(tmp_path, fuse_cpu_ops=False)
    assert (back.model_type, back.head_layout, back.hidden_source) == (
        rt.model_type, rt.head_layout, rt.hidden_source
    )
    a, b = params_np(rt), params_np(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k
    tokens = mx.array(np.random.default_rng(seed).integers(0, rt.vocab_size, (2, 5)), dtype=mx.int32)
    (l1, h1), (l2, h2) = rt.forward(tokens), back.forward(tokens)
    assert mx.array_equal(l1, l2).item() and mx.array_equal(h1, h2).item()
    assert mx.array_equal(rt.head_forward(h1, tokens), back.head_forward(h2, tokens)).item()
    # The default, fused load computes the same logits up to float32 rounding.
    fused = mtplx_ext.load(tmp_path)
    assert fused.cpu_ops_fused and not back.cpu_ops_fused
    lf, hf = fused.forward(tokens)
    np.testing.assert_allclose(np.array(lf), np.array(l1), rtol=1e-3, atol=1e-3)
    hl_fused, hl = fused.head_forward(hf, tokens), rt.head_forward(h1, tokens)
    np.testing.assert_allclose(np.array(hl_fused), np.array(hl), rtol=1e-3, atol=1e-3)
    # Saving the loaded model again writes the same tensors.
    back.save(tmp_path / "again")
    f1, f2 = saved(tmp_path), saved(tmp_path / "again")
    assert f1.keys() == f2.keys() and all(np.array_equal(f1[k], f2[k]) for k in f1)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stored_head_norms_follow_layout_convention(tmp_path, seed, case):
    family, layout = case
    rt = randomized(family, layout, seed)
    rt.save(tmp_path)
    stored = saved(tmp_path)
    n = rt.config["num_hidden_layers"]
    norm_keys = head_norm_keys(layout, family, n)
    pre = head_prefix(layout, n)
    head_stored = {k for k in stored if k.startswith(pre)}
    assert norm_keys <= head_stored
    assert len(head_stored) == len(tree_flatten(rt.head.parameters()))
    # Qwen3-Next norms are stored zero-centred: the model scales by 1 + stored.
    check_norm_scales(rt, stored, norm_keys, 1.0 if layout == "qwen3_next" else 0.0, seed)
    # The trunk's own final norm is stored as mlx-lm holds it and used as is.
    x = np.random.default_rng(seed + 1).normal(size=(2, rt.config["hidden_size"]))
    norm = rt.trunk.model.norm
    key = ("language_model." if family == "qwen3_5" else "") + "model.norm.weight"
    np.testing.assert_allclose(
        np.array(norm(mx.array(x, dtype=mx.float32)), dtype=np.float64),
        _rms64(x, stored[key].astype(np.float64), norm.eps),
        rtol=1e-5,
        atol=1e-5,
    )


def test_zero_centred_head_norms_of_a_checkpoint_load_plus_one_and_save_back(tmp_path, seed):
    rt = randomized("qwen3_next", "qwen3_next", seed)
    rt.save(tmp_path / "a")
    weights = saved(tmp_path / "a")
    rng = np.random.default_rng(seed + 1)
    keys = head_norm_keys("qwen3_next", "qwen3_next", rt.config["num_hidden_layers"])
    # A checkpoint as published: small zero-centred values, full float32 precision.
    for k in keys:
        weights[k] = (rng.normal(size=weights[k].shape) * 0.05).astype(np.float32)
    src = tmp_path / "hf"
    src.mkdir()
    save_file(weights, src / "model.safetensors")
    (src / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    back = mtplx_ext.load(src)
    check_norm_scales(back, weights, keys, 1.0, seed)
    back.save(tmp_path / "b")
    again = saved(tmp_path / "b")
    assert again.keys() == weights.keys()
    assert all(np.array_equal(again[k], weights[k]) for k in weights)


@pytest.mark.parametrize("case", CASES[:6], ids=IDS[:6])
def test_mlx_lm_load_model_reads_saved_trunk_with_same_logits(tmp_path, seed, case):
    rt = randomized(*case, seed)
    rt.save(tmp_path)
    model, _ = load_model(Path(tmp_path), strict=False)
    tokens = mx.array(np.random.default_rng(seed).integers(0, rt.vocab_size, (2, 6)), dtype=mx.int32)
    assert mx.array_equal(model(tokens), rt.forward(tokens)[0]).item()


def test_tied_embedding_model_round_trips_and_mlx_lm_reads_it(tmp_path, seed):
    rt = randomized("qwen3", "qwen3_next", seed, tie_word_embeddings=True)
    assert "lm_head" not in rt.trunk
    rt.save(tmp_path)
    assert not any(k.startswith("lm_head") for k in load_file(tmp_path / "model.safetensors"))
    back = mtplx_ext.load(tmp_path)
    a, b = params_np(rt), params_np(back)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    tokens = mx.array(np.random.default_rng(seed).integers(0, rt.vocab_size, (2, 5)), dtype=mx.int32)
    model, _ = load_model(Path(tmp_path), strict=False)
    logits, hidden = rt.forward(tokens)
    assert mx.array_equal(model(tokens), logits).item()
    emb = np.array(rt.trunk.model.embed_tokens.weight, dtype=np.float64)
    x = rt.head(hidden, rt.trunk.model.embed_tokens(tokens))
    np.testing.assert_allclose(
        np.array(rt.head_forward(hidden, tokens), dtype=np.float64),
        np.array(x, dtype=np.float64) @ emb.T,
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_hf_expert_head_weights_are_stacked_on_load(tmp_path, seed, family):
    rt = randomized(family, "qwen3_next", seed, num_experts=4, num_experts_per_tok=2)
    rt.save(tmp_path / "a")
    w = saved(tmp_path / "a")
    pre = "mtp.layers.0.mlp."
    sw = {p: w.pop(f"{pre}switch_mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")}
    if family == "qwen3_next":  # one tensor per expert, as Qwen3-Next stores them
        for proj, stacked in sw.items():
            for e, part in enumerate(stacked):
                w[f"{pre}experts.{e}.{proj}.weight"] = part
    else:  # fused tensors, as Qwen3.5 MoE stores them
        w[f"{pre}experts.gate_up_proj"] = np.concatenate([sw["gate_proj"], sw["up_proj"]], axis=-2)
        w[f"{pre}experts.down_proj"] = sw["down_proj"]
    (tmp_path / "hf").mkdir()
    save_file(w, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    a, b = params_np(rt), params_np(mtplx_ext.load(tmp_path / "hf"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_nested_text_config_loads_like_flat_config(tmp_path, seed):
    rt = randomized("qwen3_5", "qwen3_next", seed)
    rt.save(tmp_path)
    flat = json.loads((tmp_path / "config.json").read_text())
    keep = ("model_type", "mtp_head_layout", "mtp_hidden_source")
    nested = {k: flat[k] for k in keep}
    nested["text_config"] = {k: v for k, v in flat.items() if k not in keep}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    back = mtplx_ext.load(tmp_path, fuse_cpu_ops=False)
    assert back.vocab_size == rt.vocab_size and back.head_layout == "qwen3_next"
    tokens = mx.array(np.random.default_rng(seed).integers(0, rt.vocab_size, (2, 5)), dtype=mx.int32)
    (l1, h1), (l2, h2) = rt.forward(tokens), back.forward(tokens)
    assert mx.array_equal(l1, l2).item()
    assert mx.array_equal(rt.head_forward(h1, tokens), back.head_forward(h2, tokens)).item()


def test_deepseek_head_block_in_hf_form_is_converted_like_the_trunk(tmp_path, seed):
    rt = randomized("deepseek_v3", "deepseek", seed)
    rt.save(tmp_path / "a")
    w = saved(tmp_path / "a")
    cfg = rt.config
    n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    pre = f"model.layers.{n}."
    # MLA: HF stores kv_b_proj [heads * (nope + v), kv_lora]; mlx-lm splits it.
    wk = w.pop(f"{pre}self_attn.embed_q.weight")  # [heads, kv_lora, nope]
    wv = w.pop(f"{pre}self_attn.unembed_out.weight")  # [heads, v, kv_lora]
    kv_b = np.concatenate([wk.transpose(0, 2, 1), wv], axis=1).reshape(heads * (wk.shape[2] + wv.shape[1]), -1)
    w[f"{pre}self_attn.kv_b_proj.weight"] = np.ascontiguousarray(kv_b)
    for proj in ("gate_proj", "down_proj", "up_proj"):
        for e, part in enumerate(w.pop(f"{pre}mlp.switch_mlp.{proj}.weight")):
            w[f"{pre}mlp.experts.{e}.{proj}.weight"] = part
    w[f"{pre}embed_tokens.weight"] = w["model.embed_tokens.weight"]  # DeepSeek's duplicate copy
    (tmp_path / "hf").mkdir()
    save_file(w, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    a, b = params_np(rt), params_np(mtplx_ext.load(tmp_path / "hf"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_layout_is_detected_from_weight_names_without_config_field(tmp_path, seed):
    for family, layout in CASES[:6]:
        rt = randomized(family, layout, seed)
        d = tmp_path / layout
        rt.save(d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("mtp_head_layout")
        cfg.pop("mtp_hidden_source")
        (d / "config.json").write_text(json.dumps(cfg))
        back = mtplx_ext.load(d)
        assert back.head_layout == layout and back.hidden_source == rt.hidden_source
    plain = randomized("qwen3", None, seed)
    plain.save(tmp_path / "plain")
    back = mtplx_ext.load(tmp_path / "plain")
    assert not back.has_mtp and back.head is None


def test_tokenizer_json_is_saved_and_loaded(tmp_path, seed):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(50)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    rt = randomized("qwen3", "qwen3_next", seed)
    rt.tokenizer = tok
    rt.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    back = mtplx_ext.load(tmp_path)
    text = " ".join(np.random.default_rng(seed).choice(words, 8))
    assert back.tokenizer.encode(text).ids == tok.encode(text).ids


def test_bad_folders_and_configs_raise_clear_errors(tmp_path, seed):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mtplx_ext.load(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        mtplx_ext.load(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        mtplx_ext.load(tmp_path / "empty")
    rt = randomized("qwen3", "qwen3_next", seed)
    good = tmp_path / "good"
    rt.save(good)
    cfg = json.loads((good / "config.json").read_text())

    def variant(name, config, weights=True):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        if weights:
            for f in good.glob("*.safetensors"):
                (d / f.name).write_bytes(f.read_bytes())
        return d

    with pytest.raises(ValueError, match="model_type"):
        mtplx_ext.load(variant("no_type", {k: v for k, v in cfg.items() if k != "model_type"}))
    with pytest.raises(ValueError, match="model_type"):
        mtplx_ext.load(variant("bad_type", {**cfg, "model_type": "no_such_family"}))
    with pytest.raises(ValueError, match="head_layout"):
        mtplx_ext.load(variant("bad_layout", {**cfg, "mtp_head_layout": "medusa"}))
    with pytest.raises(ValueError, match="mtp_hidden_source"):
        mtplx_ext.load(variant("bad_source", {**cfg, "mtp_hidden_source": "middle"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        mtplx_ext.load(variant("no_weights", cfg, weights=False))
    with pytest.raises(ValueError):  # weights of another shape
        mtplx_ext.load(variant("wrong_size", {**cfg, "hidden_size": 32}))
    (good / "model-00002-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match="other weight files"):
        rt.save(good)


# -- bad inputs: each a one-line error naming the field, key or file ----------------------------


@pytest.fixture()
def good_folder(tmp_path, seed) -> Path:
    rt = randomized("qwen3", "qwen3_next", seed)
    from tokenizers import Tokenizer, models as tok_models

    rt.tokenizer = Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(8)}, unk_token="w0"))
    rt.save(tmp_path / "good")
    return tmp_path / "good"


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


_DROP = object()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": _DROP}, r"config\.json: required field 'hidden_size' is missing"),
        ({"vocab_size": "512"}, r"config\.json: vocab_size must be a positive integer, got '512'"),
        ({"num_attention_heads": 0}, r"config\.json: num_attention_heads must be a positive integer, got 0"),
        ({"num_key_value_heads": 0}, r"num_key_value_heads must be a positive integer"),
        ({"rope_theta": -10000.0}, r"config\.json: rope_theta must be a positive finite number"),
        ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a positive finite number"),
    ],
    ids=["no-hidden-size", "string-vocab", "zero-heads", "zero-kv-heads", "negative-rope-theta", "nan-eps"],
)
def test_bad_config_fields_raise_one_line_errors_naming_the_field(good_folder, changes, message):
    _edit_config(good_folder, **changes)
    with pytest.raises(mtplx_ext.CheckpointError, match=message) as info:
        mtplx_ext.load(good_folder)
    assert "\n" not in str(info.value)


def test_config_naming_a_head_without_mtp_weights_says_so_and_names_mtp_from(good_folder):
    (good_folder / "mtp.safetensors").unlink()
    (good_folder / "model.safetensors.index.json").unlink()
    with pytest.raises(mtplx_ext.CheckpointError, match=r"names MTP head layout 'qwen3_next'.*no MTP head tensors.*--mtp-from"):
        mtplx_ext.load(good_folder)


def test_partial_head_names_the_missing_head_tensors(good_folder):
    w = load_file(good_folder / "mtp.safetensors")
    w.pop("mtp.fc.weight")
    save_file(w, good_folder / "mtp.safetensors")
    (good_folder / "model.safetensors.index.json").unlink()
    with pytest.raises(mtplx_ext.CheckpointError, match=r"MTP head .* missing 1 tensor\(s\): mtp\.fc\.weight"):
        mtplx_ext.load(good_folder)


def test_wrong_shape_tensor_names_its_checkpoint_key(good_folder):
    w = load_file(good_folder / "mtp.safetensors")
    w["mtp.pre_fc_norm_hidden.weight"] = w["mtp.pre_fc_norm_hidden.weight"][:-1].copy()
    save_file(w, good_folder / "mtp.safetensors")
    with pytest.raises(mtplx_ext.CheckpointError, match=r"'mtp\.pre_fc_norm_hidden\.weight' has shape"):
        mtplx_ext.load(good_folder)


def test_broken_tokenizer_json_names_the_file(good_folder):
    (good_folder / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(mtplx_ext.CheckpointError, match=r"tokenizer\.json is not a valid tokenizer file"):
        mtplx_ext.load(good_folder)


@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"], ids=["empty", "bad-header"])
def test_unreadable_safetensors_file_names_the_file(good_folder, content):
    (good_folder / "mtp.safetensors").write_bytes(content)
    with pytest.raises(mtplx_ext.CheckpointError, match=r"mtp\.safetensors is not a"):
        mtplx_ext.load(good_folder)


def test_shard_named_in_the_index_but_missing_names_the_shard(good_folder):
    (good_folder / "mtp.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"names shard 'mtp\.safetensors', which is missing"):
        mtplx_ext.load(good_folder)


@pytest.mark.parametrize("corruption", ["empty-weights", "broken-tokenizer", "string-vocab"])
def test_cli_on_a_corrupt_model_folder_prints_one_error_line_and_exits_2(good_folder, capsys, corruption):
    from mtplx_ext import cli

    if corruption == "empty-weights":
        (good_folder / "model.safetensors").write_bytes(b"")
    elif corruption == "broken-tokenizer":
        (good_folder / "tokenizer.json").write_text("{")
    else:
        _edit_config(good_folder, vocab_size="512")
    assert cli.main(["generate", "w1 w2", "--model", str(good_folder), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mtplx-ext: error: ") and "Traceback" not in "".join(err)


# -- quantized folders ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(mtplx_ext.checkpoints.SMALL_CONFIGS))
def test_init_random_quantized_round_trips_and_mlx_lm_reads_the_trunk_strictly(tmp_path, seed, family):
    rt = mtplx_ext.init_random(family, seed=seed, quantize={"bits": 4, "group_size": 32})
    assert any(hasattr(m, "scales") for _, m in rt.head.named_modules())
    rt.save(tmp_path)
    back = mtplx_ext.load(tmp_path, fuse_cpu_ops=False)
    a, b = params_np(rt), params_np(back)
    assert a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in a)
    tokens = mx.array(np.random.default_rng(seed).integers(0, rt.vocab_size, (2, 6)), dtype=mx.int32)
    (l1, h1), (l2, h2) = rt.forward(tokens), back.forward(tokens)
    assert mx.array_equal(l1, l2).item()
    assert mx.array_equal(rt.head_forward(h1, tokens), back.head_forward(h2, tokens)).item()
    model, _ = load_model(Path(tmp_path), strict=True)
    assert mx.array_equal(model(tokens), l1).item()


def test_folder_written_by_mlx_lm_with_per_layer_overrides_loads_with_its_logits(tmp_path, seed):
    from mlx_lm.utils import quantize_model, save_config, save_model

    rt = randomized("qwen3", None, seed)
    rt.save(tmp_path / "float")
    model, config = load_model(tmp_path / "float")

    def predicate(path, module):  # mlx-lm's per-layer form: a dict, or False to keep a layer in float
        if path.startswith("model.layers.0."):
            return {"group_size": 32, "bits": 8}
        if path.endswith("mlp.down_proj"):
            return False
        return True

    with contextlib.redirect_stdout(io.StringIO()):
        model, config = quantize_model(model, config, 32, 4, quant_predicate=predicate)
    save_model(tmp_path / "q", model)
    save_config(config, tmp_path / "q" / "config.json")
    q = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert q["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 8}
    back = mtplx_ext.load(tmp_path / "q", fuse_cpu_ops=False)
    bits = {n: m.bits for n, m in back.trunk.named_modules() if hasattr(m, "scales")}
    assert bits["model.layers.0.self_attn.q_proj"] == 8 and bits["model.layers.1.self_attn.q_proj"] == 4
    assert "model.layers.1.mlp.down_proj" not in bits
    tokens = mx.array(np.random.default_rng(seed).integers(0, rt.vocab_size, (2, 6)), dtype=mx.int32)
    assert mx.array_equal(model(tokens), back.forward(tokens)[0]).item()
