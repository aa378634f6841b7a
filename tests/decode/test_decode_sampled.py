"""Sampled speculative decoding end to end: generate_batched with a SamplerConfig.

On random qwen3 models, the first two tokens of many independent streams
(one stream per seed, all in one batch) must follow the model's sampled
distribution, P(t1) p(t2 | t1) after the sampler's transforms (penalties
counting t1 at the second position), both with MTP drafts and with plain
sampling (G-test: p >= 1e-5, `_stats.ALPHA_EXACT`). The same test rejects a decode whose
verification is deliberately broken. Streams must not depend on the batch.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.sampling import counts_with, distribution_from_logits
from _broken_rules import target_one_position_late
from _joint import expected_chain_joint, expected_joint
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue
import _seed

N = 4000

SETTINGS = {
    # Small vocabulary, hot: the head's drafts are often accepted.
    "vocab16_hot_top_p_presence": (16, SamplerConfig(temperature=3.0, top_p=0.95, presence_penalty=0.5)),
    # Full vocabulary, top-k: drafts mostly rejected (residual draws).
    "vocab512_top_k": (512, SamplerConfig(temperature=0.8, top_k=6, frequency_penalty=0.4)),
}


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


def first_two(rt, prompt, cfg, seeds, *, mtp: bool) -> tuple[np.ndarray, float]:
    res = mtplx_ext.generate_batched(
        rt, [prompt] * len(seeds), max_new_tokens=2, sampler=cfg, row_seeds=seeds, use_mtp_draft=mtp, depth=1
    )
    pairs = np.array([s.tokens for s in res.streams])
    assert pairs.shape == (len(seeds), 2)
    return pairs, res.acceptance_rate


def pair_pvalue(rt, prompt, cfg, pairs) -> float:
    V = rt.vocab_size
    joint = expected_joint(rt, prompt, cfg)
    return g_test_pvalue(np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V), joint.reshape(-1))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_mtp_and_plain_sampling_give_the_models_first_two_token_distribution(rng, name):
    vocab, cfg = SETTINGS[name]
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=vocab)
    prompt = rng.integers(0, vocab, size=int(rng.integers(2, 7))).tolist()
    seeds = (int(rng.integers(1 << 40)) + np.arange(N)).tolist()
    mtp_pairs, acc = first_two(rt, prompt, cfg, seeds, mtp=True)
    plain_pairs, _ = first_two(rt, prompt, cfg, seeds, mtp=False)
    p_mtp = pair_pvalue(rt, prompt, cfg, mtp_pairs)
    p_plain = pair_pvalue(rt, prompt, cfg, plain_pairs)
    assert p_mtp >= ALPHA_EXACT, f"MTP sampling off the model's distribution: p = {p_mtp:.2e} (acceptance {acc:.3f})"
    assert p_plain >= ALPHA_EXACT, f"plain sampling off the model's distribution: p = {p_plain:.2e}"
    # Same seeds, same first token: x0 is drawn the same way in both loops.
    assert np.array_equal(mtp_pairs[:, 0], plain_pairs[:, 0])


def test_sampling_at_4_bits_on_the_quantized_gemm_gives_the_models_distribution(rng):
    """The packed 4-bit model (the CPU's quantized GEMM, as `load` packs it) samples its own distribution."""
    from mtplx_ext.models.packed_quantized import PackedQuantizedLinear

    vocab, cfg = SETTINGS["vocab16_hot_top_p_presence"]
    rt = mtplx_ext.init_random(
        "qwen3", seed=int(rng.integers(1 << 30)), vocab_size=vocab, fuse_cpu_ops=True,
        quantize={"bits": 4, "group_size": 32},
    )
    assert any(isinstance(m, PackedQuantizedLinear) for m in rt.modules())
    prompt = rng.integers(0, vocab, size=int(rng.integers(2, 7))).tolist()
    seeds = (int(rng.integers(1 << 40)) + np.arange(N)).tolist()
    pairs, acc = first_two(rt, prompt, cfg, seeds, mtp=True)
    p = pair_pvalue(rt, prompt, cfg, pairs)
    assert p >= ALPHA_EXACT, f"4-bit MTP sampling off the model's distribution: p = {p:.2e} (acceptance {acc:.3f})"


def test_the_same_test_rejects_a_decode_with_broken_verification(rng, monkeypatch):
    import mtplx_ext.decode.policies as policies

    vocab, cfg = SETTINGS["vocab16_hot_top_p_presence"]
    broken_rule = target_one_position_late(policies.verify_sampled_chain)
    # Accepted or not, every draft position reads the wrong target: no need to draw a head that drafts well.
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=vocab)
    prompt = rng.integers(0, vocab, size=4).tolist()
    seeds = (int(rng.integers(1 << 40)) + np.arange(N)).tolist()
    with monkeypatch.context() as m:
        m.setattr(policies, "verify_sampled_chain", broken_rule)
        broken, _ = first_two(rt, prompt, cfg, seeds, mtp=True)
    assert pair_pvalue(rt, prompt, cfg, broken) < ALPHA_BROKEN


def test_stream_tokens_do_not_depend_on_batch_composition_order_or_pipelining(rng):
    vocab = 64
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=vocab)
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(1, 9, size=6)]
    seeds = [int(s) for s in rng.integers(1 << 62, size=6)]
    cfgs = [
        SamplerConfig(temperature=float(rng.uniform(0.5, 2.0)), top_p=0.9, frequency_penalty=0.3)
        if i % 3
        else SamplerConfig(temperature=0.0, presence_penalty=0.5)  # greedy with penalties, in the same batch
        for i in range(6)
    ]

    def run(order, serial=False):
        res = mtplx_ext.generate_batched(
            rt,
            [prompts[i] for i in order],
            max_new_tokens=12,
            sampler=[cfgs[i] for i in order],
            row_seeds=[seeds[i] for i in order],
            serial=serial, depth=1,
        )
        return {i: s.tokens for i, s in zip(order, res.streams)}

    alone = {i: run([i])[i] for i in (0, 1, 2)}
    full = run([0, 1, 2, 3, 4, 5])
    shuffled = run([5, 2, 4, 0, 3, 1])
    serial = run([1, 0, 2], serial=True)
    for i in (0, 1, 2):
        assert full[i] == alone[i] == shuffled[i] == serial[i]
    assert full == shuffled


def test_sampled_decode_rejects_bad_sampler_arguments(rng):
    rt = mtplx_ext.init_random("qwen3", seed=1, vocab_size=32)
    prompts = [[1, 2], [3]]
    with pytest.raises(ValueError, match="row_seeds"):
        mtplx_ext.generate_batched(rt, prompts, max_new_tokens=2, sampler=SamplerConfig(), row_seeds=[1], depth=1)
    with pytest.raises(ValueError, match="sampler"):
        mtplx_ext.generate_batched(rt, prompts, max_new_tokens=2, sampler=[SamplerConfig()] * 3, depth=1)


@pytest.mark.parametrize("reject_mode", ["repair", "reforward"])
def test_greedy_with_penalties_commits_the_plain_decoding_tokens_under_mtp(rng, reject_mode):
    # Penalties depend on every committed token, so a draft or a dropped
    # draft counted by mistake changes the argmax at some later position.
    # A small vocabulary and ~150 drafts: a random head's drafts are right
    # often enough that some are accepted (all rejected: p < 1e-4).
    vocab = 16
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=vocab)
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(1, 9, size=8)]
    cfg = SamplerConfig(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3)
    kw = dict(max_new_tokens=40, sampler=cfg, seed=0)
    plain = mtplx_ext.generate_batched(rt, prompts, use_mtp_draft=False, **kw, depth=1)
    mtp = mtplx_ext.generate_batched(rt, prompts, reject_mode=reject_mode, **kw, depth=1)
    assert 0 < mtp.accepted < mtp.drafted  # both paths of the cycle were taken
    for i, (a, b) in enumerate(zip(plain.streams, mtp.streams)):
        assert a.tokens == b.tokens, f"stream {i}"


def test_streams_with_nearby_row_seeds_never_share_a_uniform():
    # Each (stream, cycle, call) must get its own uniform. Keys derived by
    # xor-ing the cycle and call into a seed's low word would hand stream
    # 0's draw at cycle 1 to stream 4 at cycle 0 when seeds are 0, 1, 2, ...
    from mtplx_ext.decode.policies import SampledPolicy

    B, steps, calls = 64, 8, 4
    policy = SampledPolicy(SamplerConfig(temperature=1.0), row_seeds=list(range(B)))
    policy.pick(mx.zeros((B, 8)), 0)  # sets the policy up for B rows
    u = np.concatenate([np.array(policy.uniforms(s, range(calls))).reshape(-1) for s in range(steps)])
    assert u.size == B * steps * calls
    # Independent float32 uniforms collide by chance with probability ~1e-2 here.
    assert u.size - np.unique(u).size <= 1


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("penalties", [False, True])
def test_depth_k_sampling_gives_the_models_joint_distribution_of_the_first_k_plus_1_tokens(rng, depth, penalties):
    V, n = 8, depth + 1
    cfg = SamplerConfig(temperature=2.0, top_p=0.97, presence_penalty=0.6 if penalties else 0.0,
                        frequency_penalty=0.3 if penalties else 0.0)
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=V)
    prompt = rng.integers(0, V, size=int(rng.integers(2, 6))).tolist()
    seeds = (int(rng.integers(1 << 40)) + np.arange(6000)).tolist()
    res = mtplx_ext.generate_batched(
        rt, [prompt] * len(seeds), max_new_tokens=n, sampler=cfg, row_seeds=seeds, depth=depth
    )
    seqs = np.array([s.tokens for s in res.streams])
    assert seqs.shape == (len(seeds), n)
    assert res.reached[depth - 1] > 0, "no cycle reached the last draft: the chain was not exercised"
    idx = np.ravel_multi_index(tuple(seqs.T), (V,) * n)
    p = g_test_pvalue(np.bincount(idx, minlength=V**n), expected_chain_joint(rt, prompt, cfg, n))
    assert p >= ALPHA_EXACT, f"depth-{depth} sampling off the model's distribution: p = {p:.2e}"


def test_the_depth_test_rejects_a_chain_that_tests_acceptance_against_the_next_target(rng, monkeypatch):
    import mtplx_ext.decode.policies as policies

    V, depth = 8, 2
    cfg = SamplerConfig(temperature=2.0, top_p=0.97)
    # Draft i tested against, and resampled from, p_{i+1} (`_broken_rules`).
    monkeypatch.setattr(policies, "verify_sampled_chain", target_one_position_late(policies.verify_sampled_chain))
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=V)
    prompt = rng.integers(0, V, size=4).tolist()
    seeds = (int(rng.integers(1 << 40)) + np.arange(6000)).tolist()
    res = mtplx_ext.generate_batched(rt, [prompt] * len(seeds), max_new_tokens=3, sampler=cfg, row_seeds=seeds, depth=depth)
    seqs = np.array([s.tokens for s in res.streams])
    idx = np.ravel_multi_index(tuple(seqs.T), (V,) * 3)
    assert g_test_pvalue(np.bincount(idx, minlength=V**3), expected_chain_joint(rt, prompt, cfg, 3)) < ALPHA_BROKEN


class NaNHead:
    """A runtime whose MTP head's logits are all NaN (a broken head checkpoint)."""

    def __init__(self, rt):
        self.rt = rt

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def head_logits(self, normed):
        logits = self.rt.head_logits(normed)
        return logits + mx.array(float("nan"), logits.dtype)


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_nan_mtp_head_only_loses_its_drafts_and_never_blames_the_target(rng, depth, sampled):
    # A broken head is a bad proposal: every draft is rejected and the
    # stream goes on from the target's own tokens, greedy or sampled.
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=64)
    prompts = [rng.integers(0, 64, size=int(n)).tolist() for n in rng.integers(1, 8, size=3)]
    kw = dict(sampler=SamplerConfig(temperature=1.0, top_p=0.9, presence_penalty=0.3), row_seeds=[1, 2, 3]) if sampled else {}
    r = mtplx_ext.generate_batched(NaNHead(rt), prompts, max_new_tokens=10, depth=depth, **kw)
    assert r.drafted > 0
    # Sampled: an unusable q row rejects its draft. Greedy: the argmax of a
    # NaN row is some token, right only by chance (the tokens say the rest).
    assert r.accepted == 0 or not sampled
    assert all(len(s.tokens) == 10 and all(0 <= t < 64 for t in s.tokens) for s in r.streams)
    if not sampled:  # greedy: exactly the target's own decoding
        plain = mtplx_ext.generate_batched(rt, prompts, max_new_tokens=10, use_mtp_draft=False)
        assert [s.tokens for s in r.streams] == [s.tokens for s in plain.streams]
