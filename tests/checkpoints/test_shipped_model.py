"""The model shipped inside the package: loads, is small, and its head drafts well."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest

import _seed

import mtplx_ext
from mtplx_ext import train
from mtplx_ext.shipped import SHIPPED_MODEL

SHIPPED = SHIPPED_MODEL


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED)


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    return tuple(train.stdlib_files())


def _random_stdlib_snippet(rng: random.Random, chars: int) -> str:
    files = _stdlib_files()
    text = ""
    while len(text) < chars:
        text = train.read_text(rng.choice(files))
    start = rng.randrange(0, len(text) - chars + 1)
    return text[start : start + chars]


def test_shipped_folder_is_complete_and_at_most_25_mb():
    names = {p.name for p in SHIPPED.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= names
    size = sum(p.stat().st_size for p in SHIPPED.iterdir() if p.is_file())
    assert size <= 25 * 2**20


def test_shipped_folder_loads_with_a_qwen3_next_head_and_tokenizer(shipped):
    assert shipped.model_type == "qwen3"
    assert shipped.has_mtp and shipped.head_layout == "qwen3_next"
    assert shipped.tokenizer is not None
    assert shipped.tokenizer.get_vocab_size() == shipped.vocab_size


def test_shipped_trunk_loads_in_mlx_lm_and_gives_the_same_logits(shipped):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(SHIPPED, strict=False)
    tokens = mx.array([[random.randrange(shipped.vocab_size) for _ in range(9)]])
    ours, _ = shipped.forward(tokens)
    theirs = model(tokens)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-5)


def test_tokenizer_round_trips_random_stdlib_text(shipped):
    rng = random.Random(_seed.fresh())
    for _ in range(5):
        text = _random_stdlib_snippet(rng, 300)
        ids = shipped.tokenizer.encode(text).ids
        assert shipped.tokenizer.decode(ids) == text


def test_shipped_head_drafts_far_better_than_an_untrained_head(shipped):
    # The trained head must be accepted often; a random head of the same shape
    # almost never is. Prompts: random snippets of stdlib code.
    rng = random.Random(_seed.fresh())
    # 8 prompts: with 2, a single degenerate loop can sink the rate (seen once at 0.16).
    prompts = [shipped.tokenizer.encode(_random_stdlib_snippet(rng, 120)).ids for _ in range(8)]
    res = mtplx_ext.generate_greedy_batched(shipped, prompts, max_new_tokens=32, depth=1)
    cfg = {k: shipped.config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "intermediate_size", "head_dim")}
    untrained = mtplx_ext.init_random("qwen3", rng.randrange(1 << 30), head_layout="qwen3_next", **cfg)
    base = mtplx_ext.generate_greedy_batched(untrained, prompts, max_new_tokens=32, depth=1)
    assert res.acceptance_rate >= 0.3
    assert res.acceptance_rate > base.acceptance_rate + 0.2


def test_shipped_readme_names_the_data_license_and_the_command():
    text = (SHIPPED / "README.md").read_text()
    assert "Python Software Foundation" in text
    assert "python -m mtplx_ext.train" in text
    assert "acceptance" in text


def test_shipped_head_drafts_well_when_chained_at_depth_3(shipped):
    # Chained on its own output, the head's second and third drafts of a
    # cycle must be accepted often too (an untrained head's almost never are).
    rng = random.Random(_seed.fresh())
    prompts = [shipped.tokenizer.encode(_random_stdlib_snippet(rng, 120)).ids for _ in range(8)]
    res = mtplx_ext.generate_greedy_batched(shipped, prompts, max_new_tokens=48, depth=3)
    per = res.acceptance_per_depth
    assert min(r for r in res.reached) > 20, res.reached
    assert per[1] >= 0.5 and per[2] >= 0.5, per
    assert res.mean_accepted_length >= 1.0
