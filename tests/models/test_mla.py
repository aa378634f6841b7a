"""DeepSeek-V3's attention in one formula for decode-sized blocks (`models.mla`).

A verification forward of K + 1 tokens must compute what K + 1 plain steps
compute, bit for bit, or MTP commits plain decoding's tokens only up to
rounding. mlx-lm's attention takes another formula for one query than for
several: without the patch the two differ (the check can fail), with it they
are equal, a single query still computes exactly mlx-lm's, and prompt-sized
blocks keep mlx-lm's own code.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mtplx_ext
from mtplx_ext.models.mla import ABSORBED_MAX_L, patch_mla_one_formula
import _seed


@pytest.fixture(scope="module")
def model():
    return mtplx_ext.init_random("deepseek_v3", seed=_seed.fresh(), head_layout="deepseek").trunk


def _prefilled(model, prompt):
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    return cache


def _block_and_steps(model, prompt, block):
    """Logits of `block` forwarded at once and one token at a time, after the same prompt."""
    cache = _prefilled(model, prompt)
    at_once = model(mx.array([block]), cache=cache)[0]
    cache = _prefilled(model, prompt)
    steps = mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in block], axis=0)
    return np.array(at_once), np.array(steps)


def test_a_verification_block_computes_what_plain_steps_compute_bit_for_bit(model, rng):
    V = model.args.vocab_size
    prompt = rng.integers(0, V, int(rng.integers(20, 40))).tolist()
    block = rng.integers(0, V, int(rng.integers(2, ABSORBED_MAX_L + 1))).tolist()
    a, b = _block_and_steps(model, prompt, block)
    assert not np.array_equal(a, b), "mlx-lm's two formulas agreed bit for bit: the check below would be blind"
    with patch_mla_one_formula():
        a, b = _block_and_steps(model, prompt, block)
    assert np.array_equal(a, b), np.abs(a - b).max()


def test_one_query_and_prompt_sized_blocks_compute_what_mlx_lm_computes(model, rng):
    V = model.args.vocab_size
    prompt = rng.integers(0, V, ABSORBED_MAX_L + 1 + int(rng.integers(0, 20))).tolist()
    token = [int(rng.integers(V))]
    ours = []
    for patched in (False, True):
        with patch_mla_one_formula() if patched else contextlib.nullcontext():
            cache = make_prompt_cache(model)
            ours.append((np.array(model(mx.array([prompt]), cache=cache)), np.array(model(mx.array([token]), cache=cache))))
    (p0, t0), (p1, t1) = ours
    assert np.array_equal(p0, p1) and np.array_equal(t0, t1)


def test_the_patch_is_undone_and_does_not_stack():
    from mlx_lm.models.deepseek_v3 import DeepseekV3Attention

    original = DeepseekV3Attention.__call__
    with patch_mla_one_formula() as outer:
        assert outer.active and DeepseekV3Attention.__call__ is not original
        with patch_mla_one_formula() as inner:
            assert not inner.active
    assert DeepseekV3Attention.__call__ is original



def test_decode_sessions_route_deepseek_trunks_only():
    from mlx_lm.models.deepseek_v3 import DeepseekV3Attention

    from mtplx_ext.decode.session import one_mla_formula

    original = DeepseekV3Attention.__call__
    deepseek = mtplx_ext.init_random("deepseek_v3", seed=_seed.fresh(), head_layout="deepseek")
    qwen = mtplx_ext.init_random("qwen3", seed=_seed.fresh())
    with one_mla_formula(deepseek):
        assert DeepseekV3Attention.__call__ is not original
    with one_mla_formula(qwen):
        assert DeepseekV3Attention.__call__ is original
    assert DeepseekV3Attention.__call__ is original
