"""Gemma 4 assistant drafters against transformers' Gemma4AssistantForCausalLM.

Random targets and assistants built with transformers (norms and layer
scalars perturbed), loaded here: the target equals Gemma4ForCausalLM, and one
draft step over the target's KV, from its hidden state and a token, equals the
assistant's logits and projected state within float32 tolerance for every row
of a ragged batch (its own left padding and its own rollback: several
positions, prompts longer than the sliding window), through a sliding and a
full layer, and with the E2B-style centroid head. Bad pairs fail in one line
naming the field.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from _gemma4 import WINDOW, make_pair
from _greedy import check_stream, reference
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

import mtplx_ext
from mtplx_ext.cache import rollback
from mtplx_ext.checkpoints import CheckpointError
from mtplx_ext.models import gemma4_assistant as ga
from mtplx_ext.models import gemma4_trunk
import _seed

TOL = 2e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4")
    return make_pair(folder, int(_seed.rng().integers(1 << 30)))


def _close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    err = np.abs(got - ref) / (1 + np.abs(ref))
    assert err.max() <= TOL, f"{what}: max relative error {err.max():.3g}"


def test_the_target_equals_transformers_with_ragged_caches_over_prompts_longer_than_the_window(pair, rng):
    t_path, _ = pair
    rt = mtplx_ext.load(t_path, fuse_cpu_ops=False)
    hf = Gemma4ForCausalLM.from_pretrained(t_path).eval()
    ids = rng.integers(0, rt.vocab_size, size=(2, 3 * WINDOW)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor(ids), output_hidden_states=True).logits.numpy()
    cache = rt.make_cache([0, 0], ragged=True, capacity=64)
    cut = int(rng.integers(WINDOW + 1, 2 * WINDOW))
    a, _ = rt.forward(mx.array([r[:cut] for r in ids]), cache)
    b, _ = rt.forward(mx.array([r[cut:] for r in ids]), cache)
    _close(np.concatenate([np.array(a), np.array(b)], axis=1), ref, "target logits")


def _hf_step(hf, rt, cache, row: int, pad: int, n: int, emb: np.ndarray, hid: np.ndarray):
    """transformers' assistant on row `row`'s n committed positions (batch of one, no padding)."""
    kv = {}
    for kind, i in gemma4_trunk.kv_sources(rt.trunk).items():
        c = cache[i]
        k = np.array(c.keys[row : row + 1, :, pad : pad + n])
        v = np.array(c.values[row : row + 1, :, pad : pad + n])
        kv[kind] = (torch.tensor(k), torch.tensor(v))
    x = torch.cat([torch.tensor(emb), torch.tensor(hid)], dim=-1)
    with torch.no_grad():
        out = hf(inputs_embeds=x, position_ids=torch.tensor([[n]]), shared_kv_states=kv)
    return out.logits.numpy()[0], out.last_hidden_state.numpy()[0]


def _check_steps(rt, hf, rng, steps: int = 2) -> None:
    B = 4
    lens = rng.integers(WINDOW + 2, 4 * WINDOW, size=B)
    width = int(lens.max())
    pads = [width - int(n) for n in lens]
    ids = [[0] * p + rng.integers(0, rt.vocab_size, size=int(n)).tolist() for p, n in zip(pads, lens)]
    cache = rt.make_cache(pads, ragged=True, capacity=width + 8)
    _, hidden = rt.forward(mx.array(ids), cache)
    # Several positions: each stream rolls back its own count (as after a verification).
    drop = rng.integers(0, min(int(lens.min()) - 2, 2 * WINDOW), size=B)
    rollback.rollback_streams(cache, mx.array(drop.astype(np.int32)))
    at = mx.array((width - 1 - drop).astype(np.int32))
    h = mx.take_along_axis(hidden, at[:, None, None], axis=1)
    tok = mx.array(rng.integers(0, rt.vocab_size, size=B).astype(np.int32))
    a = rt.head
    frozen = ga.frozen_kv(rt.trunk, cache, a.layer_types, a.args.text.sliding_window)
    hf_h = [np.array(h[b]) [None] for b in range(B)]
    for step in range(steps):
        emb = gemma4_trunk.scaled_embed(rt.trunk, rt.trunk.model.embed_tokens(tok[:, None]))
        logits, h = a.step(emb, h, frozen)
        logits, hn = np.array(logits), np.array(h)
        for b in range(B):
            n = int(lens[b] - drop[b])
            ref_l, ref_h = _hf_step(hf, rt, cache, b, pads[b], n, np.array(emb[b : b + 1]), hf_h[b])
            _close(logits[b], ref_l, f"step {step} row {b} (n={n}) logits")
            _close(hn[b], ref_h, f"step {step} row {b} (n={n}) projected state")
            hf_h[b] = ref_h[None]
        tok = mx.argmax(mx.array(logits[:, 0]), axis=-1).astype(mx.int32)


@pytest.mark.parametrize("fuse", [False, True])
def test_draft_steps_equal_transformers_for_every_row_of_a_ragged_batch(pair, rng, fuse):
    t_path, a_path = pair
    rt = mtplx_ext.load(t_path, drafter=a_path, fuse_cpu_ops=fuse)
    assert rt.head_layout == "gemma4_assistant" and rt.make_head_cache([0]) == []
    _check_steps(rt, Gemma4AssistantForCausalLM.from_pretrained(a_path).eval(), rng)


def test_the_sliding_layer_sees_a_window_and_not_the_whole_context(pair, rng):
    # The same check with the window ignored must fail: the sliding mask is exercised.
    t_path, a_path = pair
    rt = mtplx_ext.load(t_path, drafter=a_path, fuse_cpu_ops=False)
    rt.head.args.text.sliding_window = 10**6
    with pytest.raises(AssertionError, match="logits"):
        _check_steps(rt, Gemma4AssistantForCausalLM.from_pretrained(a_path).eval(), rng, steps=1)


def test_the_centroid_head_equals_transformers(tmp_path, rng):
    t_path, a_path = make_pair(tmp_path, int(rng.integers(1 << 30)), centroids=16)
    rt = mtplx_ext.load(t_path, drafter=a_path, fuse_cpu_ops=False)
    assert rt.head.args.use_ordered_embeddings
    _check_steps(rt, Gemma4AssistantForCausalLM.from_pretrained(a_path).eval(), rng)


def _edit(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in fields.items():
        scope = cfg
        *outer, last = k.split(".")
        for o in outer:
            scope = scope[o]
        scope[last] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"backbone_hidden_size": 32}, "backbone_hidden_size = 32"),
        ({"text_config.vocab_size": 128}, "text_config.vocab_size = 128"),
        ({"text_config.global_head_dim": 64, "text_config.per_layer_config": {}}, "text_config.global_head_dim = 64"),
    ],
)
def test_bad_pairs_fail_in_one_line_naming_the_field(tmp_path, rng, fields, named):
    t_path, a_path = make_pair(tmp_path, int(rng.integers(1 << 30)))
    _edit(a_path, **fields)
    with pytest.raises(CheckpointError, match=named) as e:
        mtplx_ext.load(t_path, drafter=a_path)
    assert "\n" not in str(e.value)


def test_a_target_without_the_needed_layer_type_is_refused(tmp_path, rng):
    # transformers forces a full layer last, so this target is built with mlx-lm directly.
    from mlx_lm.models import gemma4_text

    from mtplx_ext.checkpoints import assistant, read_config

    _, a_path = make_pair(tmp_path, int(rng.integers(1 << 30)))
    args = gemma4_text.ModelArgs(
        hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4, head_dim=16,
        num_key_value_heads=2, num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size=256,
        vocab_size_per_layer_input=0, sliding_window=WINDOW, layer_types=["sliding_attention"] * 3,
    )
    cfg = read_config(a_path)
    with pytest.raises(CheckpointError, match=r"layer_types\[1\] = 'full_attention'.*no full_attention layer"):
        assistant.build_assistant(cfg, None, "assistant", gemma4_text.Model(args))


def test_a_drafter_for_another_family_is_refused(tmp_path, rng):
    _, a_path = make_pair(tmp_path, int(rng.integers(1 << 30)))
    other = tmp_path / "qwen3"
    mtplx_ext.init_random("qwen3", seed=0).save(other)
    with pytest.raises(CheckpointError, match="target's model_type is 'qwen3'"):
        mtplx_ext.load(other, drafter=a_path)
    with pytest.raises(CheckpointError, match="model_type 'qwen3' is not a drafter"):
        mtplx_ext.load(other, drafter=other)


def test_convert_writes_an_mlx_drafter_folder_float_bit_exact_and_quantized_like_the_trunk(pair, tmp_path, rng):
    from mtplx_ext import cli

    t_path, a_path = pair
    assert cli.main(["convert", "--drafter", str(a_path), str(t_path), str(tmp_path / "f")]) == 0
    assert cli.main(["convert", "--drafter", str(a_path), str(t_path), str(tmp_path / "q"), "-q", "--q-bits", "8",
                     "--q-group-size", "32"]) == 0
    hf = mtplx_ext.load(t_path, drafter=a_path, fuse_cpu_ops=False)
    fl = mtplx_ext.load(t_path, drafter=tmp_path / "f", fuse_cpu_ops=False)
    qt = mtplx_ext.load(t_path, drafter=tmp_path / "q", fuse_cpu_ops=False)
    assert isinstance(qt.head.pre_projection, nn.QuantizedLinear)
    assert isinstance(qt.head.model.embed_tokens, nn.QuantizedEmbedding)
    packed = mtplx_ext.load(t_path, drafter=tmp_path / "q")  # the CPU's packed layers, as decoding loads it
    assert not isinstance(packed.head.pre_projection, nn.QuantizedLinear)
    prompts = [rng.integers(0, 256, size=int(rng.integers(WINDOW + 1, 3 * WINDOW))).tolist() for _ in range(3)]
    runs = [mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=8, depth=2) for rt in (hf, fl, qt, packed)]
    # Lossless with either drafter: each run equals mlx-lm's greedy decode of
    # the target (different drafts verify different query counts, so the
    # runs may part from each other only where the reference is a near tie).
    for p, *streams in zip(prompts, *(r.streams for r in runs)):
        ref, gaps = reference(hf, p, 8)
        for i, s in enumerate(streams):
            check_stream(i, s, ref, gaps, set(), 8)
    assert runs[0].accepted_at == runs[1].accepted_at  # the float folder drafts as the HF one
    # The 8-bit drafter's step stays near the float one's: relative L2 error of
    # the logits under 0.1 (8-bit, group 32 lands at 0.007-0.03 over random
    # pairs; a 4-bit drafter, 16x coarser, at 0.15-0.52, so the bound can fail).
    cache = hf.make_cache([0], ragged=True, capacity=64)
    _, hidden = hf.forward(mx.array([prompts[0]]), cache)
    emb = gemma4_trunk.scaled_embed(hf.trunk, hf.trunk.model.embed_tokens(mx.array([[3]])))
    fr = ga.frozen_kv(hf.trunk, cache, hf.head.layer_types, WINDOW)
    a, _ = hf.head.step(emb, hidden[:, -1:], fr)
    b, _ = qt.head.step(emb, hidden[:, -1:], fr)
    rel = float(mx.sqrt(((a - b) ** 2).sum() / (a**2).sum()))
    assert 0 < rel < 0.1, f"8-bit drafter logits: relative L2 error {rel:.3g}"


def test_cli_refuses_a_missing_drafter_and_a_target_without_one_in_one_line(pair, tmp_path, capsys):
    from mtplx_ext import cli

    t_path, _ = pair
    assert cli.main(["generate", "--model", str(t_path), "--drafter", str(tmp_path / "none"), "x"]) == 2
    assert "--drafter" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(t_path), "x"]) == 2
    err = capsys.readouterr().err
    assert "no MTP head weights" in err and "--drafter" in err and err.count("\n") == 1
