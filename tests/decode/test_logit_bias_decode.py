"""logit_bias end to end with MTP on: generate_batched and the continuous-batching Engine.

Greedy decoding with a bias must equal the argmax of the biased logits of
full trunk forwards of the committed sequence (float64); sampled MTP
decoding with a bias must follow the biased target's distribution of the
first two tokens (G-test); a +100 bias forces its token and -100 bans it in
greedy and sampled decoding; in the Engine a biased request decodes as alone
beside unbiased neighbours, and a bias naming a token outside the vocabulary
is refused at submit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _engine import drive
from _stats import ALPHA_EXACT
from test_decode_sampled import first_two, pair_pvalue

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine
from mtplx_ext.sampling import biased_logits
import _seed


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


def last_logits(rt, toks: list[int]) -> np.ndarray:
    return np.array(rt.trunk(mx.array([toks]))[0, -1].astype(mx.float32), np.float64)


def biased_greedy_reference(rt, prompt: list[int], n: int, bias) -> list[int]:
    """Greedy decoding of the biased logits, one full forward per token (no caches)."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(np.argmax(biased_logits(last_logits(rt, toks), bias))))
    return toks[len(prompt):]


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_mtp_with_a_bias_equals_the_biased_argmax_of_full_forwards(rng, depth):
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=64)
    prompts = [rng.integers(0, 64, size=int(rng.integers(2, 8))).tolist() for _ in range(3)]
    plain = [biased_greedy_reference(rt, p, 10, ()) for p in prompts]
    # Moderate biases on tokens the plain decode uses and on others: they
    # change the argmax somewhere without forcing one token throughout.
    biases = [{int(plain[i][1]): -3.0, int(rng.integers(64)): 2.5, int(rng.integers(64)): 1.0} for i in range(3)]
    cfgs = [SamplerConfig(temperature=0.0, logit_bias=b) for b in biases]
    res = mtplx_ext.generate_batched(rt, prompts, max_new_tokens=10, sampler=cfgs, depth=depth)
    changed = 0
    for i, s in enumerate(res.streams):
        want = biased_greedy_reference(rt, prompts[i], 10, cfgs[i].logit_bias)
        assert s.tokens == want, (i, biases[i])
        changed += want != plain[i]
    assert changed >= 1  # the bias did something the test can see


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_large_biases_force_and_ban_tokens_with_mtp(rng, temperature):
    V = 64
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=V)
    prompts = [rng.integers(0, V, size=4).tolist() for _ in range(2)]
    forced = int(rng.integers(V))
    cfg = SamplerConfig(temperature=temperature, logit_bias={forced: 100.0})
    res = mtplx_ext.generate_batched(rt, prompts, max_new_tokens=12, sampler=cfg, row_seeds=[1, 2], depth=2)
    assert all(s.tokens == [forced] * 12 for s in res.streams)
    # Ban what the unbiased decode produced (greedy) or a token a hot
    # sampler draws often: none of them appear.
    free = mtplx_ext.generate_batched(rt, prompts, max_new_tokens=12,
                                      sampler=SamplerConfig(temperature=temperature), row_seeds=[1, 2], depth=2)
    banned = sorted({t for s in free.streams for t in s.tokens})
    cfg = SamplerConfig(temperature=temperature, logit_bias={t: -100.0 for t in banned})
    res = mtplx_ext.generate_batched(rt, prompts, max_new_tokens=12, sampler=cfg, row_seeds=[1, 2], depth=2)
    assert all(len(s.tokens) == 12 and not set(s.tokens) & set(banned) for s in res.streams), banned


def test_sampled_mtp_with_a_bias_follows_the_biased_distribution(rng):
    vocab = 16
    cfg = SamplerConfig(temperature=3.0, top_p=0.95, presence_penalty=0.5, logit_bias={3: 2.0, 5: -2.0, 9: 1.0})
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=vocab)
    prompt = rng.integers(0, vocab, size=4).tolist()
    seeds = (int(rng.integers(1 << 40)) + np.arange(4000)).tolist()
    pairs, _ = first_two(rt, prompt, cfg, seeds, mtp=True)
    assert pair_pvalue(rt, prompt, cfg, pairs) >= ALPHA_EXACT
    # The unbiased distribution is far from it: the bias is in effect.
    assert pair_pvalue(rt, prompt, SamplerConfig(temperature=3.0, top_p=0.95, presence_penalty=0.5), pairs) < 1e-6


def test_engine_biased_requests_decode_as_alone_beside_unbiased_ones(rng):
    V = 64
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=V)
    kws = []
    for i in range(5):
        bias = {int(rng.integers(V)): float(rng.choice([-100.0, 3.0, 100.0]))} if i % 2 == 0 else {}
        temp = 0.0 if i % 3 == 0 else 1.0
        kws.append(dict(prompt=rng.integers(0, V, size=int(rng.integers(2, 10))).tolist(), max_tokens=8,
                        sampler=SamplerConfig(temperature=temp, logit_bias=bias), seed=int(rng.integers(1 << 40))))
    alone = [
        mtplx_ext.generate_batched(rt, [kw["prompt"]], max_new_tokens=8, sampler=kw["sampler"],
                                   row_seeds=[kw["seed"]], depth=2).streams[0].tokens
        for kw in kws
    ]
    eng = Engine(rt, max_batch=3, depth=2, prefill_chunk=8)
    got = drive(eng, [(int(rng.integers(0, 12)), kw) for kw in kws])
    assert [r.tokens for r in got] == alone
    for kw, toks in zip(kws, alone):
        for t, b in kw["sampler"].logit_bias:
            if b == 100.0:
                assert toks == [t] * 8
            elif b == -100.0:
                assert t not in toks
    with pytest.raises(ValueError, match="logit_bias"):
        eng.submit([1, 2], sampler=SamplerConfig(logit_bias={V: 1.0}))
