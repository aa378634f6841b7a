"""grow: a wider, deeper folder that computes the shipped model's function.

Three comparisons, each able to fail (the broken growths at the end must be
caught by the same ones):

- Exactness, float64: a NumPy float64 forward of the grown weights against
  the same forward of the shipped weights. With w = 2 every grown weight is
  the source weight tiled or halved (exact in binary), so the two compute the
  same function and differ only by float64 summation order (~1e-13 on logits
  of magnitude ~10): the tolerance 1e-9 is far above that and far below any
  real mistake (O(0.1) and more).
- Float32 rounding: the package's float32 runtime (trunk and head, chained
  drafts too) against the float64 forward of the shipped weights. The shipped
  model's own float32 error E on the same tokens is the unit; the grown
  model's dot products sum w times more terms and its inserted blocks add exact
  zeros, so its error is expected near sqrt(w) E and is allowed 4 w E.
- Decoding: greedy tokens of the grown model (plain and MTP, depth 1 and 2)
  equal mlx-lm's greedy decoding of the shipped trunk, a near tie of the
  reference allowed as in the other lossless tests; its head is accepted as
  often as the shipped head.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext import cli
from mtplx_ext.checkpoints import grow as grow_mod
from mtplx_ext.shipped import SHIPPED_MODEL
from _greedy import TIE_TOL, check_stream, reference

SHIPPED = SHIPPED_MODEL
TOKENS = [17, 5, 770, 300, 12, 900, 4, 4, 7, 1000, 1500, 33, 2047, 0, 81, 640]
EXACT_TOL = 1e-9


# -- a NumPy float64 reference forward of qwen3 + the qwen3_next head ------------


def _np_weights(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: np.array(v.astype(mx.float32)).astype(np.float64) for k, v in mx.load(str(f)).items()})
    return out


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, base):  # [heads, T, D], mlx-lm's non-traditional RoPE at positions 0..T-1
    T, D = x.shape[-2:]
    ang = np.arange(T)[:, None] * base ** (-np.arange(D // 2) * 2.0 / D)[None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x1 * np.sin(ang) + x2 * np.cos(ang)], -1)


def _layer(W, p, x, cfg, zero_centred):
    n = (lambda w: 1.0 + w) if zero_centred else (lambda w: w)
    eps, hd, base = cfg["rms_norm_eps"], cfg["head_dim"], cfg["rope_theta"]
    nq, nkv, T = cfg["num_attention_heads"], cfg["num_key_value_heads"], x.shape[0]
    h = _rms(x, n(W[p + "input_layernorm.weight"]), eps)

    def heads(name, count):
        return (h @ W[p + f"self_attn.{name}.weight"].T).reshape(T, count, hd).transpose(1, 0, 2)

    q = _rope(_rms(heads("q_proj", nq), n(W[p + "self_attn.q_norm.weight"]), eps), base)
    k = _rope(_rms(heads("k_proj", nkv), n(W[p + "self_attn.k_norm.weight"]), eps), base)
    v = heads("v_proj", nkv)
    k, v = np.repeat(k, nq // nkv, axis=0), np.repeat(v, nq // nkv, axis=0)  # query head j reads KV head j // G
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    o = ((a / a.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(T, nq * hd)
    x = x + o @ W[p + "self_attn.o_proj.weight"].T
    h = _rms(x, n(W[p + "post_attention_layernorm.weight"]), eps)
    g, u = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
    return x + (g / (1.0 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T


def _np_forward(folder: Path, tokens: list[int]):
    """(trunk logits, head logits, chained head logits): float64, positions 0..T-1."""
    cfg = json.loads((folder / "config.json").read_text())
    W = _np_weights(folder)
    E = W["model.embed_tokens.weight"]
    lm = W.get("lm_head.weight", E)
    eps = cfg["rms_norm_eps"]
    x = E[tokens]
    for i in range(cfg["num_hidden_layers"]):
        x = _layer(W, f"model.layers.{i}.", x, cfg, False)
    post = _rms(x, W["model.norm.weight"], eps)

    def head(hidden, nxt):
        e = _rms(E[nxt], 1.0 + W["mtp.pre_fc_norm_embedding.weight"], eps)
        h = _rms(hidden, 1.0 + W["mtp.pre_fc_norm_hidden.weight"], eps)
        y = _layer(W, "mtp.layers.0.", np.concatenate([e, h], -1) @ W["mtp.fc.weight"].T, cfg, True)
        return _rms(y, 1.0 + W["mtp.norm.weight"], eps)

    h1 = head(post[:-1], tokens[1:])
    h2 = head(h1[:-1], tokens[2:])  # chained: the head's own output state, the next token
    return post @ lm.T, h1 @ lm.T, h2 @ lm.T


def _mlx_forward(rt, tokens: list[int]):
    """The same three logits from the package's float32 runtime."""
    t = mx.array([tokens])
    logits, hidden = rt.forward(t)
    h1_logits, h1 = rt.head_forward(hidden[:, :-1], t[:, 1:], return_hidden=True)
    h2_logits = rt.head_forward(h1[:, :-1], t[:, 2:])
    return tuple(np.array(a[0]).astype(np.float64) for a in (logits, h1_logits, h2_logits))


def _max_errors(got, want) -> list[float]:
    return [float(np.abs(g - w).max()) for g, w in zip(got, want)]


@pytest.fixture(scope="module")
def exact_shipped():
    return _np_forward(SHIPPED, TOKENS)


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED)


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    return grow_mod.grow(SHIPPED, tmp_path_factory.mktemp("g") / "w2d2", width=2, depth=2)


# -- layout and loading ------------------------------------------------------------


def test_grown_folder_is_a_qwen3_folder_with_the_head_and_tokenizer(grown):
    names = {p.name for p in grown.iterdir()}
    assert names == {"config.json", "model.safetensors", "model.safetensors.index.json", "mtp.safetensors",
                     "tokenizer.json", "tokenizer_config.json", "README.md"}
    cfg = json.loads((grown / "config.json").read_text())
    src = json.loads((SHIPPED / "config.json").read_text())
    assert cfg["hidden_size"] == 2 * src["hidden_size"] and cfg["num_hidden_layers"] == 2 * src["num_hidden_layers"]
    assert cfg["num_attention_heads"] == 2 * src["num_attention_heads"]
    assert cfg["num_key_value_heads"] == 2 * src["num_key_value_heads"] and cfg["head_dim"] == src["head_dim"]
    assert cfg["tie_word_embeddings"] is False and cfg["mtp_head_layout"] == "qwen3_next"
    readme = (grown / "README.md").read_text()
    assert f"mtplx-ext grow {grown} --width 2 --depth 2" in readme
    index = json.loads((grown / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        v.nbytes for f in grown.glob("*.safetensors") for v in mx.load(str(f)).values())
    # Inserted blocks (odd layers) write nothing into the residual.
    w = mx.load(str(grown / "model.safetensors"))
    assert not np.any(np.array(w["model.layers.1.mlp.down_proj.weight"]))
    assert not np.any(np.array(w["model.layers.3.self_attn.o_proj.weight"]))
    assert np.any(np.array(w["model.layers.1.mlp.up_proj.weight"]))


def test_mlx_lm_load_reads_the_grown_trunk_with_the_shipped_logits(grown, shipped, exact_shipped):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(grown))
    assert tokenizer.encode("import os") == shipped.tokenizer.encode("import os").ids
    ours = np.array(model(mx.array([TOKENS]))[0]).astype(np.float64)
    e_ref = _max_errors(_mlx_forward(shipped, TOKENS), exact_shipped)[0]
    assert _max_errors([ours], exact_shipped)[0] <= 4 * 2 * e_ref


def test_mtplx_load_reads_the_whole_grown_folder(grown):
    rt = mtplx_ext.load(grown)
    assert rt.model_type == "qwen3" and rt.head_layout == "qwen3_next" and rt.hidden_source == "post_norm"
    assert len(rt.trunk.model.layers) == 16 and rt.tokenizer is not None


# -- the function ------------------------------------------------------------------


def test_grown_weights_compute_the_shipped_function_exactly_in_float64(grown, exact_shipped):
    errors = _max_errors(_np_forward(grown, TOKENS), exact_shipped)
    assert max(errors) < EXACT_TOL, errors


@pytest.mark.parametrize("width, depth", [(2, 2), (3, 1)])
def test_grown_runtime_equals_the_shipped_function_up_to_float32_rounding(
    tmp_path, grown, shipped, exact_shipped, width, depth
):
    # Width 3 also divides by a number whose inverse is not a binary fraction.
    folder = grown if (width, depth) == (2, 2) else grow_mod.grow(SHIPPED, tmp_path / "g", width=width, depth=depth)
    rt = mtplx_ext.load(folder)
    e_ref = _max_errors(_mlx_forward(shipped, TOKENS), exact_shipped)
    got = _mlx_forward(rt, TOKENS)
    errors = _max_errors(got, exact_shipped)
    for what, e, r in zip(("trunk", "head", "chained head"), errors, e_ref):
        assert 0 < r < 1e-3 and e <= 4 * width * r, (what, e, r)
    # The drafts (argmax of the head logits) are the shipped head's, but at a near tie.
    for g, want in zip(got[1:], exact_shipped[1:]):
        top = np.sort(want, axis=-1)[:, -2:]
        same = g.argmax(-1) == want.argmax(-1)
        assert np.all(same | (top[:, 1] - top[:, 0] < TIE_TOL))


def test_greedy_decoding_of_the_grown_model_equals_the_shipped_model(grown, shipped):
    texts = ["import os\nimport sys\n\n\ndef main(", "class Parser:\n    def __init__(self, text):\n",
             "for i in range(10):\n    if i %"]
    prompts = [shipped.tokenizer.encode(t).ids for t in texts]
    cap = 24
    refs = [reference(shipped, p, cap) for p in prompts]
    rt = mtplx_ext.load(grown)
    for kw in (dict(use_mtp_draft=False), dict(depth=1), dict(depth=2)):
        r = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=cap, **kw)
        for i, s in enumerate(r.streams):
            check_stream(i, s, *refs[i], set(), cap)
        if kw.get("use_mtp_draft", True):
            base = mtplx_ext.generate_greedy_batched(shipped, prompts, max_new_tokens=cap, **kw)
            assert abs(r.acceptance_rate - base.acceptance_rate) <= 0.05, (r.acceptance_rate, base.acceptance_rate)
            assert r.acceptance_rate >= 0.3


def test_grow_is_deterministic_and_shards_load(tmp_path):
    a = grow_mod.grow(SHIPPED, tmp_path / "a", width=2, depth=1)
    b = grow_mod.grow(SHIPPED, tmp_path / "b", width=2, depth=1)
    for f in a.iterdir():
        if f.name != "README.md":
            assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    assert (a / "README.md").read_text().replace(str(a), str(b)) == (b / "README.md").read_text()
    c = grow_mod.grow(SHIPPED, tmp_path / "c", width=2, depth=1, shard_bytes=8 * 2**20)
    shards = sorted(p.name for p in c.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    from mlx_lm.utils import load_model

    model, _ = load_model(c, strict=True)
    t = mx.array([TOKENS])
    np.testing.assert_array_equal(np.array(model(t)), np.array(mtplx_ext.load(a, fuse_cpu_ops=False).forward(t)[0]))


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, exc, message",
    [
        (dict(width=0, depth=1), ValueError, "width must be an int >= 1"),
        (dict(width=1.5, depth=1), TypeError, "width must be an int"),
        (dict(width=2.0, depth=1), TypeError, "width must be an int"),
        (dict(width="2", depth=1), TypeError, "width must be an int"),
        (dict(width=True, depth=1), TypeError, "width must be an int"),
        (dict(width=2, depth=0), ValueError, "depth must be an int >= 1"),
        (dict(width=2, depth=-1), ValueError, "depth must be an int >= 1"),
        (dict(width=2, depth=1.5), TypeError, "depth must be an int"),
        (dict(width=2, depth=1, dtype="int8"), ValueError, "dtype must be one of"),
        (dict(width=2, depth=1, shard_bytes=0), ValueError, "shard_bytes must be an int >= 1"),
    ],
)
def test_bad_growth_factors_name_the_argument_and_write_nothing(tmp_path, kw, exc, message):
    with pytest.raises(exc, match=message):
        grow_mod.grow(SHIPPED, tmp_path / "out", **kw)
    assert list(tmp_path.iterdir()) == []


def _saved(tmp_path: Path, name: str, *args, **kw) -> Path:
    mtplx_ext.init_random(*args, **kw).save(tmp_path / name)
    return tmp_path / name


def test_sources_that_cannot_grow_are_refused_naming_src(tmp_path):
    cases = [
        (_saved(tmp_path, "hybrid", "qwen3_next"), "trunk family 'qwen3_next'"),
        (_saved(tmp_path, "deepseek_head", "qwen3", head_layout="deepseek"), "head layout 'deepseek'"),
        (_saved(tmp_path, "quantized", "qwen3", quantize={"bits": 4, "group_size": 32}), "quantized"),
        (tmp_path / "missing", "does not exist"),
    ]
    out = tmp_path / "out"
    for src, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=f"src: .*{message}"):
            grow_mod.grow(src, out, width=2, depth=2)
        assert not out.exists()


def test_a_non_empty_dst_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="dst"):
        grow_mod.grow(SHIPPED, tmp_path / "out", width=2, depth=1)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    assert grow_mod.grow(SHIPPED, tmp_path / "empty", width=1, depth=1) == tmp_path / "empty"


def test_a_random_qwen3_without_head_grows_too(tmp_path):
    src = _saved(tmp_path, "plain", "qwen3", head_layout=None, seed=3)
    out = grow_mod.grow(src, tmp_path / "out", width=2, depth=3)
    a, b = mtplx_ext.load(src, fuse_cpu_ops=False), mtplx_ext.load(out, fuse_cpu_ops=False)
    assert b.head is None and len(b.trunk.model.layers) == 3 * len(a.trunk.model.layers)
    t = mx.array([[1, 2, 3, 4, 5, 6]])
    np.testing.assert_allclose(np.array(b.forward(t)[0]), np.array(a.forward(t)[0]), rtol=0, atol=1e-4)


def test_cli_grow_writes_the_folder_and_reports_errors(tmp_path, capsys):
    assert cli.main(["grow", str(tmp_path / "o"), "--width", "1", "--depth", "2"]) == 0
    assert "16 layers" in capsys.readouterr().err
    assert cli.main(["grow", str(tmp_path / "p"), "--width", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtplx-ext: error:") and err.count("\n") == 1 and "width must be an int >= 1" in err


# -- the comparisons catch a broken growth ------------------------------------------


@pytest.mark.parametrize(
    "broken, patch",
    [
        ("inputs not divided by w", ("_split_columns", lambda a, w: np.tile(a, (w, w)))),
        ("inserted output projections not zeroed", ("_zero_output", lambda a: a)),
        ("fc tiled whole, ignoring the concat order", ("_fc", lambda a, w: np.tile(a / w, (w, w)))),
        ("lm_head not divided by w", ("_lm_head", lambda a, w: np.tile(a, (1, w)))),
    ],
)
def test_a_broken_growth_is_detected(tmp_path, monkeypatch, exact_shipped, broken, patch):
    monkeypatch.setattr(grow_mod, *patch)
    folder = grow_mod.grow(SHIPPED, tmp_path / "broken", width=2, depth=2)
    errors = _max_errors(_np_forward(folder, TOKENS), exact_shipped)
    assert max(errors) > 1e3 * EXACT_TOL, (broken, errors)
    # Caught by the float32 runtime comparison too (its tolerance is ~1e-4).
    assert max(_max_errors(_mlx_forward(mtplx_ext.load(folder), TOKENS), exact_shipped)) > 1e-2, broken
