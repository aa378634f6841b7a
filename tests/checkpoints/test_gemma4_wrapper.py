"""Multimodal Gemma 4 targets (`model_type` gemma4, a vision tower around the language model).

Gemma 4 checkpoints are published as Gemma4ForConditionalGeneration; text
decoding runs the language model alone. A random text target wrapped by
transformers with a vision tower must load (the tower dropped, the text
weights found under their wrapped names, the vocabulary read from
text_config), give transformers' text-only logits over prompts longer than
the sliding window, and draft losslessly with an assistant.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from _gemma4 import WINDOW, make_pair, wrap_target
from _greedy import check_stream, reference
from transformers import Gemma4ForConditionalGeneration

import mtplx_ext
from mtplx_ext.checkpoints import CheckpointError
import _seed

TOL = 2e-5
N_NEW = 16


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4_wrapped")
    seed = int(_seed.rng().integers(1 << 30))
    t, a = make_pair(folder, seed, repeat=0.25)
    return wrap_target(t, folder / "wrapped", seed + 7), a


def test_the_folder_is_a_multimodal_checkpoint_with_a_tower(wrapped):
    w, _ = wrapped
    config = json.loads((w / "config.json").read_text())
    assert config["model_type"] == "gemma4" and "vocab_size" not in config
    from safetensors import safe_open

    with safe_open(w / "model.safetensors", "np") as f:
        assert any(k.startswith("model.vision_tower.") for k in f.keys())


def test_a_wrapped_target_gives_transformers_text_logits_with_ragged_caches(wrapped, rng):
    w, _ = wrapped
    rt = mtplx_ext.load(w, fuse_cpu_ops=False)
    hf = Gemma4ForConditionalGeneration.from_pretrained(w).eval()
    ids = rng.integers(0, rt.vocab_size, size=(2, 3 * WINDOW)).tolist()
    with torch.no_grad():
        # (output_hidden_states: transformers' shared-KV shortcut needs per-layer inputs this target has none of)
        ref = hf(input_ids=torch.tensor(ids), output_hidden_states=True).logits.numpy()
    cache = rt.make_cache([0, 0], ragged=True, capacity=64)
    cut = int(rng.integers(WINDOW + 1, 2 * WINDOW))
    a, _ = rt.forward(mx.array([r[:cut] for r in ids]), cache)
    b, _ = rt.forward(mx.array([r[cut:] for r in ids]), cache)
    got = np.concatenate([np.array(a), np.array(b)], axis=1)
    err = np.abs(got - ref) / (1 + np.abs(ref))
    assert err.max() <= TOL, f"max relative error {err.max():.3g}"


@pytest.mark.parametrize("depth,batch", [(2, 1), (3, 3)])
def test_mtp_with_an_assistant_on_a_wrapped_target_equals_decoding_the_target_alone(wrapped, rng, depth, batch):
    w, a = wrapped
    rt = mtplx_ext.load(w, drafter=a)
    # Some random prompts lead a random pair into a stretch the assistant never guesses: draw fresh prompts
    # (each draw checked lossless) until one decode accepts drafts, so the test exercises acceptance.
    for _ in range(4):
        prompts = [rng.integers(0, rt.vocab_size, size=int(rng.integers(WINDOW + 1, 3 * WINDOW))).tolist()
                   for _ in range(batch)]
        refs = [reference(rt, p, N_NEW) for p in prompts]
        r = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=N_NEW, depth=depth)
        for i, (s, (ref, gaps)) in enumerate(zip(r.streams, refs)):
            check_stream(i, s, ref, gaps, set(), N_NEW)
        if r.accepted > 0:
            break
    assert r.accepted > 0 and r.cycles < N_NEW * batch  # drafts were accepted


def test_a_wrapper_without_a_text_config_is_refused_naming_it(wrapped, tmp_path):
    w, _ = wrapped
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((w / "config.json").read_text())
    del config["text_config"]
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((w / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="text_config"):
        mtplx_ext.load(bad)
