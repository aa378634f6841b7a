"""convert / convert --mtp-from on checkpoints in the published MTP layouts (tests/_hf_layouts.py)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from safetensors.numpy import load_file, save_file

import _hf_layouts as L
import mtplx_ext
from mtplx_ext import cli
from mtplx_ext.checkpoints import convert
from mtplx_ext.checkpoints import CheckpointError
from mtplx_ext.models import packed_quantized
from mtplx_ext.shipped import EOS_TOKEN, SHIPPED_MODEL
import _seed

FAMILIES = list(L.CONFIGS)

#: Top-2 gap (nats) below which a batched / single-stream argmax flip is a tie.
TIE_TOL = 1e-4


@pytest.fixture(scope="module")
def seed() -> int:
    s = _seed.fresh()
    print(f"random seed {s}")
    return s


@pytest.fixture(scope="module")
def hf(tmp_path_factory, seed):
    """family -> (folder, tensors) of a published-layout checkpoint, written on first use."""
    cache: dict[str, tuple[Path, dict]] = {}

    def get(family: str) -> tuple[Path, dict]:
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"hf_{family}")
            cache[family] = (folder, L.write_checkpoint(folder, family, seed))
        return cache[family]

    return get


def saved(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def params_np(rt) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(rt.parameters())}


def assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k


def tokens(rng, vocab: int, shape=(2, 7)) -> mx.array:
    return mx.array(rng.integers(0, vocab, shape), dtype=mx.int32)


def _rms64(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def norm_scale(family: str, w: np.ndarray) -> np.ndarray:
    """What a published norm weight scales by: 1 + w where stored zero-centred."""
    return (1.0 if family in L.ZERO_CENTRED else 0.0) + w.astype(np.float64)


def fusion_reference(family: str, t: dict, hidden: np.ndarray, emb: np.ndarray) -> np.ndarray:
    """The head's first step from the published tensors alone, float64."""
    text = L.text(L.CONFIGS[family])
    eps, n = text["rms_norm_eps"], text["num_hidden_layers"]
    layout = L.LAYOUT[family]
    if layout == "qwen3_next":  # fc(cat[norm_e(emb), norm_h(hidden)])
        w, ne, nh = t["mtp.fc.weight"], t["mtp.pre_fc_norm_embedding.weight"], t["mtp.pre_fc_norm_hidden.weight"]
        first, second = _rms64(emb, norm_scale(family, ne), eps), _rms64(hidden, norm_scale(family, nh), eps)
    elif layout == "deepseek":  # eh_proj(cat[enorm(emb), hnorm(hidden)])
        p = f"model.layers.{n}."
        w = t[p + "eh_proj.weight"]
        first = _rms64(emb, norm_scale(family, t[p + "enorm.weight"]), eps)
        second = _rms64(hidden, norm_scale(family, t[p + "hnorm.weight"]), eps)
    else:  # MiMo: input_proj(cat[hidden_layernorm(hidden), token_layernorm(emb)])
        p = "model.mtp_layers.0."
        w = t[p + "input_proj.weight"]
        first = _rms64(hidden, norm_scale(family, t[p + "hidden_layernorm.weight"]), eps)
        second = _rms64(emb, norm_scale(family, t[p + "token_layernorm.weight"]), eps)
    return np.concatenate([first, second], axis=-1) @ w.astype(np.float64).T


def final_norm_key(family: str) -> str:
    lead = {"qwen3_next": "mtp.", "deepseek": "model.layers.{N}.shared_head.", "mimo": "model.mtp_layers.0."}
    name = {"qwen3_next": "norm", "deepseek": "norm", "mimo": "final_layernorm"}
    n = L.text(L.CONFIGS[family])["num_hidden_layers"]
    layout = L.LAYOUT[family]
    return lead[layout].format(N=n) + name[layout] + ".weight"


def check_norms_once(rt, family: str, t: dict, seed: int) -> None:
    """Head fusion, head final norm and trunk final norm against float64 references from the published tensors."""
    text = L.text(L.CONFIGS[family])
    h, eps = text["hidden_size"], text["rms_norm_eps"]
    rng = np.random.default_rng(seed)
    hidden, emb = rng.normal(size=(3, h)), rng.normal(size=(3, h))
    got = rt.head.combine(mx.array(hidden[None], dtype=mx.float32), mx.array(emb[None], dtype=mx.float32))
    np.testing.assert_allclose(np.array(got[0], dtype=np.float64), fusion_reference(family, t, hidden, emb),
                               rtol=1e-4, atol=1e-4, err_msg="head fusion")
    got = rt.head.final_norm(mx.array(hidden, dtype=mx.float32))
    ref = _rms64(hidden, norm_scale(family, t[final_norm_key(family)]), eps)
    np.testing.assert_allclose(np.array(got, dtype=np.float64), ref, rtol=1e-4, atol=1e-4, err_msg="head norm")
    key = "model.language_model.norm.weight" if family.startswith("qwen3_5") else "model.norm.weight"
    got = rt.trunk.model.norm(mx.array(hidden, dtype=mx.float32))
    ref = _rms64(hidden, norm_scale(family, t[key]), eps)
    np.testing.assert_allclose(np.array(got, dtype=np.float64), ref, rtol=1e-4, atol=1e-4, err_msg="trunk norm")


# -- layouts, float --------------------------------------------------------------------------


def test_fixtures_hold_the_published_head_tensor_counts(hf):
    # Qwen3.5-0.8B's dense head has 15 mtp.* tensors; the others add their MoE experts.
    folder, t = hf("qwen3_5")
    assert len(L.head_keys("qwen3_5", t)) == 15
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    last = sorted(set(index.values()))[-1]
    assert {index[k] for k in L.head_keys("qwen3_5", t)} == {last}


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_keeps_the_head_and_applies_each_norm_convention_once(tmp_path, hf, seed, family):
    folder, t = hf(family)
    summary = convert.convert(folder, tmp_path / "out")
    assert summary["layout"] == L.LAYOUT[family]
    rt = mtplx_ext.load(tmp_path / "out", fuse_cpu_ops=False)
    assert rt.head_layout == L.LAYOUT[family]
    check_norms_once(rt, family, t, seed)
    # The trunk is what mlx-lm itself makes of the published checkpoint (its sanitize, its modules).
    # strict=False: mlx-lm's deepseek_v3 sanitize only drops layer 61, the published MTP index.
    ref, _ = load_model(folder, strict=False)
    x = tokens(np.random.default_rng(seed), rt.vocab_size)
    assert mx.array_equal(ref(x), rt.forward(x)[0]).item()
    # The head's own tensors are stored as published: never shifted, never rounded.
    stored = load_file(tmp_path / "out" / convert.HEAD_FILE)
    own = {k.format(N=L.text(L.CONFIGS[family])["num_hidden_layers"]) for k in L.HEAD_OWN[L.LAYOUT[family]]}
    for k in own - {k for k in own if k.endswith("embed_tokens.weight")}:
        assert np.array_equal(stored[k], t[k]), k
    # mlx-lm reads the trunk of the folder strictly (the head sits in a file it does not read).
    strict, _ = load_model(tmp_path / "out", strict=True)
    assert mx.array_equal(strict(x), rt.forward(x)[0]).item()


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3", "mimo"])
def test_norm_check_rejects_a_head_norm_shifted_twice(tmp_path, hf, seed, family):
    folder, t = hf(family)
    convert.convert(folder, tmp_path / "out")
    stored = load_file(tmp_path / "out" / convert.HEAD_FILE)
    key = final_norm_key(family)
    # The bug of MTPLX issue 306 (or its mirror for a family that is not zero-centred).
    stored[key] = stored[key] + np.float32(1.0 if family in L.ZERO_CENTRED else -1.0)
    save_file(stored, tmp_path / "out" / convert.HEAD_FILE)
    rt = mtplx_ext.load(tmp_path / "out", fuse_cpu_ops=False)
    with pytest.raises(AssertionError, match="head norm"):
        check_norms_once(rt, family, t, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_load_save_load_round_trip_is_bit_exact(tmp_path, hf, seed, family):
    folder, _ = hf(family)
    convert.convert(folder, tmp_path / "out")
    a = mtplx_ext.load(tmp_path / "out", fuse_cpu_ops=False)
    a.save(tmp_path / "again")
    b = mtplx_ext.load(tmp_path / "again", fuse_cpu_ops=False)
    assert_bit_equal(params_np(a), params_np(b))
    assert_bit_equal(saved(tmp_path / "out"), saved(tmp_path / "again"))
    x = tokens(np.random.default_rng(seed), a.vocab_size)
    (la, ha), (lb, hb) = a.forward(x), b.forward(x)
    assert mx.array_equal(la, lb).item()
    assert mx.array_equal(a.head_forward(ha, x), b.head_forward(hb, x)).item()
    # The published folder read directly gives the same head (no conversion step changes it).
    direct = mtplx_ext.load(folder, fuse_cpu_ops=False)
    ld, hd = direct.forward(x)
    assert mx.array_equal(direct.head_forward(hd, x), a.head_forward(ha, x)).item()


def test_block_fp8_deepseek_checkpoint_converts_to_its_dequantized_weights(tmp_path, seed):
    folder = tmp_path / "hf"
    L.write_checkpoint(folder, "deepseek_v3", seed)
    expect = L.block_fp8(folder)  # float64 dequantization of the stored fp8 blocks
    convert.convert(folder, tmp_path / "out", dtype="float32")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in cfg and "quantization" not in cfg
    out = saved(tmp_path / "out")
    n = L.CONFIGS["deepseek_v3"]["num_hidden_layers"]
    for key in (f"model.layers.{n}.eh_proj.weight", "model.layers.0.self_attn.q_a_proj.weight",
                "model.layers.0.mlp.gate_proj.weight"):
        # mlx-lm dequantizes to bfloat16: 8 significant bits.
        np.testing.assert_allclose(out[key].astype(np.float64), expect[key], rtol=2**-7, atol=1e-6, err_msg=key)
    assert not any(k.endswith("weight_scale_inv") for k in out)
    rt = mtplx_ext.load(tmp_path / "out")
    assert rt.head_layout == "deepseek"


# -- quantized ---------------------------------------------------------------------------------


def _quantized_layers(module) -> dict[str, int]:
    # mlx's quantized layers, and the packed ones `load` makes of them on the CPU (`sb`: scales and biases)
    return {n: m.bits for n, m in module.named_modules() if hasattr(m, "bits") and ("scales" in m or "sb" in m)}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v3", "glm4_moe", "mimo"])
def test_quantized_convert_loads_in_mlx_lm_with_identical_trunk_logits(tmp_path, hf, seed, family, bits):
    from mlx_lm import load as mlx_lm_load

    folder, _ = hf(family)
    convert.convert(folder, tmp_path / "q", quantize=True, q_bits=bits, q_group_size=32)
    model, tokenizer = mlx_lm_load(str(tmp_path / "q"))  # strict, with the tokenizer
    rt = mtplx_ext.load(tmp_path / "q", fuse_cpu_ops=False)
    x = tokens(np.random.default_rng(seed), rt.vocab_size)
    assert mx.array_equal(model(x), rt.forward(x)[0]).item()
    # The head is quantized too, each layer recorded under its checkpoint name.
    q = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    head_q = _quantized_layers(rt.head)
    assert head_q and set(head_q.values()) <= {bits, 8}
    for name in head_q:
        assert isinstance(q[rt.head.to_checkpoint_name(name + ".weight")[: -len(".weight")]], dict), name
    # Quantized round trip: load -> save -> load is bit-exact.
    rt.save(tmp_path / "again")
    back = mtplx_ext.load(tmp_path / "again", fuse_cpu_ops=False)
    assert_bit_equal(params_np(rt), params_np(back))
    _, h = rt.forward(x)
    assert mx.array_equal(rt.head_forward(h, x), back.head_forward(h, x)).item()


def test_mtp_bits_sets_the_head_bits_apart_from_the_trunk(tmp_path, hf):
    folder, _ = hf("qwen3_next")
    convert.convert(folder, tmp_path / "a", quantize=True, q_bits=4, q_group_size=32, mtp_bits=8)
    convert.convert(folder, tmp_path / "b", quantize=True, q_bits=4, q_group_size=32, mtp_bits=None)
    a, b = mtplx_ext.load(tmp_path / "a"), mtplx_ext.load(tmp_path / "b")
    assert set(_quantized_layers(a.head).values()) == {8}
    assert set(_quantized_layers(a.trunk).values()) == {4, 8}  # mlx-lm keeps the MoE gates at 8 bits
    assert not _quantized_layers(b.head) and _quantized_layers(b.trunk)


def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out, gaps = [], []
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, -1)):
        top = np.sort(np.array(logprobs, dtype=np.float64))[-2:]
        out.append(int(tok))
        gaps.append(float(top[1] - top[0]))
    return out, gaps


def assert_lossless(streams, refs) -> None:
    for i, (s, (ref, gaps)) in enumerate(zip(streams, refs)):
        for j, (g, e) in enumerate(zip(s.tokens, ref)):
            if g != e:
                assert gaps[j] < TIE_TOL, f"stream {i} token {j}: {g} != {e}, reference gap {gaps[j]:.3g}"
                break
        else:
            assert s.tokens == ref[: len(s.tokens)] and len(s.tokens) == len(ref)


@pytest.mark.parametrize("source, bits", [("shipped", 4), ("qwen3_next", 8), ("deepseek_v3", 4)])
def test_mtp_greedy_decoding_of_a_quantized_folder_is_lossless_against_mlx_lm(tmp_path, hf, seed, source, bits):
    from mlx_lm import load as mlx_lm_load

    folder = SHIPPED_MODEL if source == "shipped" else hf(source)[0]
    convert.convert(folder, tmp_path / "q", quantize=True, q_bits=bits, q_group_size=32)
    rt = mtplx_ext.load(tmp_path / "q")  # fused CPU ops, compiled steps: the default path
    model, _ = mlx_lm_load(str(tmp_path / "q"))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, rt.vocab_size, int(n)).tolist() for n in (3, 9, 6)]
    n = 20
    # On the CPU `load` packs the quantized layers (int8 activations): MTP must commit exactly
    # the packed model's own plain tokens.
    assert any(isinstance(m, packed_quantized.PackedQuantizedLinear) for m in rt.modules())
    plain = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=n, use_mtp_draft=False)
    res = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=n, depth=1)
    assert res.drafted > 0
    assert [s.tokens for s in res.streams] == [s.tokens for s in plain.streams]
    # With mlx's quantized layers (as a GPU runs them) the same folder decodes as mlx-lm does.
    packed_quantized.unpack_cpu_quantized(rt)
    res = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=n, depth=1)
    assert res.drafted > 0
    assert_lossless(res.streams, [reference_greedy(model, p, n) for p in prompts])


@pytest.mark.parametrize("family", ["qwen3_next", "mimo"])
def test_mtp_from_adds_the_head_that_convert_of_the_full_checkpoint_has(tmp_path, hf, family):
    from mlx_lm import convert as mlx_lm_convert

    folder, t = hf(family)
    # What people download: mlx-lm's own 4-bit conversion, which dropped the head.
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm_convert(str(folder), str(tmp_path / "mlx"), quantize=True, q_bits=4, q_group_size=32, dtype="float32")
    assert not any(k in saved(tmp_path / "mlx") for k in L.head_keys(family, t))
    # The headless folder's config may still record a head it once had: stale entries are replaced.
    cfg_file = tmp_path / "mlx" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    stale = {k[: -len(".weight")]: {"group_size": 64, "bits": 8} for k in L.head_keys(family, t)
             if k.endswith(".weight") and t[k].ndim == 2}
    assert stale
    for field in ("quantization", "quantization_config"):
        cfg[field] = {**cfg[field], **stale}
    cfg_file.write_text(json.dumps(cfg))
    # Only the index and the shard holding the head are needed.
    src = tmp_path / "hf_head_only"
    src.mkdir()
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for f in ["config.json", "model.safetensors.index.json", *{index[k] for k in L.head_keys(family, t)}]:
        shutil.copy(folder / f, src / f)
    convert.add_mtp(src, tmp_path / "mlx", tmp_path / "out")
    convert.convert(folder, tmp_path / "full", quantize=True, q_bits=4, q_group_size=32, dtype="float32")
    assert_bit_equal(saved(tmp_path / "out"), saved(tmp_path / "full"))
    qa = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    qb = json.loads((tmp_path / "full" / "config.json").read_text())["quantization"]
    assert qa == qb
    rt = mtplx_ext.load(tmp_path / "out")
    assert rt.head_layout == L.LAYOUT[family] and _quantized_layers(rt.head)


def test_shipped_model_quantized_keeps_heldout_acceptance(tmp_path):
    from mtplx_ext import train

    float_rt = mtplx_ext.load(SHIPPED_MODEL)
    tok = float_rt.tokenizer
    root = train.stdlib_root()
    _, held_files = train.split_files(train.stdlib_files(root), root)
    held = train.encode_files(tok, held_files[:40])
    eos = tok.token_to_id(EOS_TOKEN)
    acc = {"float": train.heldout_decode_acceptance(float_rt, held, eos, new_tokens=32)["acceptance_batch"]}
    for bits, tol in ((8, 0.03), (4, 0.08)):
        convert.convert(SHIPPED_MODEL, tmp_path / f"q{bits}", quantize=True, q_bits=bits)
        rt = mtplx_ext.load(tmp_path / f"q{bits}")
        acc[bits] = train.heldout_decode_acceptance(rt, held, eos, new_tokens=32)["acceptance_batch"]
        print(f"held-out acceptance float {acc['float']:.3f}, {bits}-bit {acc[bits]:.3f}")
        assert abs(acc[bits] - acc["float"]) <= tol, acc


# -- errors ------------------------------------------------------------------------------------


def test_convert_of_a_folder_without_mtp_tensors_names_mtp_from(tmp_path, hf):
    folder, t = hf("qwen3_next")
    src = tmp_path / "headless"
    src.mkdir()
    shutil.copy(folder / "config.json", src / "config.json")
    save_file({k: v for k, v in t.items() if k not in L.head_keys("qwen3_next", t)}, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no MTP head tensors \(mtp\.\*\).*--mtp-from"):
        convert.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert cli.main(["convert", str(src), str(tmp_path / "out2")]) == 2


def test_convert_errors_name_the_file_or_key(tmp_path, hf):
    folder, t = hf("qwen3_next")

    def copy(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(folder, d)
        return d

    bad = copy("type")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt9"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt9'"):
        convert.convert(bad, tmp_path / "o1")
    bad = copy("shard")
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    gone = index["model.embed_tokens.weight"]
    (bad / gone).unlink()
    with pytest.raises(FileNotFoundError, match=gone):
        convert.convert(bad, tmp_path / "o2")
    bad = copy("shape")
    shard = bad / index["mtp.fc.weight"]
    w = load_file(shard)
    w["mtp.fc.weight"] = w["mtp.fc.weight"][:, :-1].copy()
    save_file(w, shard)
    with pytest.raises(CheckpointError, match=r"'mtp\.fc\.weight' has shape"):
        convert.convert(bad, tmp_path / "o3")
    assert not (tmp_path / "o3").exists()  # a failed conversion leaves nothing behind
    with pytest.raises(ValueError, match="bits=7"):
        convert.convert(folder, tmp_path / "o4", quantize=True, q_bits=7)
    with pytest.raises(CheckpointError, match="dtype"):
        convert.convert(folder, tmp_path / "o5", dtype="float8")


def test_load_rejects_a_quantization_mode_mlx_lm_does_not_have(tmp_path, seed):
    rt = mtplx_ext.init_random("qwen3", seed=seed, quantize={"bits": 4, "group_size": 32})
    rt.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization"]["mode"] = "int4_awq"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*mode 'int4_awq'"):
        mtplx_ext.load(tmp_path)


def test_cli_convert_writes_a_quantized_folder_with_its_head(tmp_path, hf, capsys):
    folder, _ = hf("mimo")
    assert cli.main(["convert", str(folder), str(tmp_path / "q"), "-q", "--q-bits", "8", "--q-group-size", "32"]) == 0
    rt = mtplx_ext.load(tmp_path / "q")
    assert rt.head_layout == "mimo" and set(_quantized_layers(rt.head).values()) == {8}
    assert cli.main(["convert", str(folder), str(tmp_path / "q")]) == 2  # not empty
    assert "mtplx-ext: error:" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert cli.main(["convert", str(folder), str(a_file)]) == 2
    err = capsys.readouterr().err
    assert f"output {str(a_file)!r} is a file, not a folder" in err and "not empty" not in err


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "deepseek_v3", "mimo"])
def test_a_checkpoint_with_several_mtp_layers_loads_each_and_convert_and_mtp_from_keep_them(tmp_path, hf, seed, family):
    from mlx_lm import convert as mlx_lm_convert

    from mtplx_ext import models

    folder, t = hf(family)
    two = tmp_path / "two"
    shutil.copytree(folder, two)
    cfg = json.loads((two / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers" if "mtp_num_hidden_layers" in text else "num_nextn_predict_layers"] = 2
    (two / "config.json").write_text(json.dumps(cfg))
    # Layer 1: layer 0's own tensors (not the ones a Qwen3-Next layout shares)
    # under the next layer's names, perturbed, so it drafts differently.
    mod = models.layout_module(L.LAYOUT[family])
    p0, p1 = mod.layer_prefix(L.text(cfg), 0), mod.layer_prefix(L.text(cfg), 1)
    extra = {p1 + k[len(p0):]: (v + np.float32(0.5)).astype(v.dtype) for k, v in t.items() if k.startswith(p0)}
    assert extra
    save_file(extra, two / "model-extra.safetensors", metadata={"format": "pt"})
    index = json.loads((two / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-extra.safetensors" for k in extra})
    (two / "model.safetensors.index.json").write_text(json.dumps(index))
    rt2 = mtplx_ext.load(two, fuse_cpu_ops=False)
    rt1 = mtplx_ext.load(folder, fuse_cpu_ops=False)
    assert len(rt1.mtp_modules) == 1 and len(rt2.mtp_modules) == 2
    assert_bit_equal(params_np(rt1), {k: v for k, v in params_np(rt2).items() if not k.startswith("more_modules.")})
    x = tokens(np.random.default_rng(seed), rt1.vocab_size)
    (_, h1), (_, h2) = rt1.forward(x), rt2.forward(x)
    assert mx.array_equal(rt1.head_forward(h1, x), rt2.head_forward(h2, x)).item()
    assert not mx.array_equal(rt2.head_forward(h2, x), rt2.head_forward(h2, x, module=1)).item()
    # Converted either way, the folder keeps layer 1.
    convert.convert(two, tmp_path / "full", dtype="float32")
    full = mtplx_ext.load(tmp_path / "full", fuse_cpu_ops=False)
    assert mx.array_equal(full.head_forward(h2, x, module=1), rt2.head_forward(h2, x, module=1)).item()
    if family not in ("qwen3_next", "mimo"):
        return  # --mtp-from reads mlx-lm conversions; mlx-lm converts these layouts (as in the --mtp-from test)
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm_convert(str(folder), str(tmp_path / "mlx"), dtype="float32")
    convert.add_mtp(two, tmp_path / "mlx", tmp_path / "added")
    assert_bit_equal(saved(tmp_path / "added"), saved(tmp_path / "full"))
    back = mtplx_ext.load(tmp_path / "added", fuse_cpu_ops=False)
    assert mx.array_equal(back.head_forward(h2, x, module=1), rt2.head_forward(h2, x, module=1)).item()
