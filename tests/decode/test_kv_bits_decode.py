"""Decoding with quantized KV (`kv_bits`): MTP is exactly plain decoding at the same bits.

A token's key and value rows are quantized on their own, the verification
writes what the one-token steps would, and the quantized attention's rows
do not depend on the call: so greedy MTP under `kv_bits` must commit
exactly the tokens of plain decoding under the same `kv_bits`, with drafts
accepted and rejected (scripted heads), on an attention trunk and a hybrid
(per-stream commit and rollback over quantized KV). Sampling under 8-bit KV
follows the model's own distribution under 8-bit KV (G-test).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext import SamplerConfig, generate_batched, generate_greedy_batched
from mtplx_ext.cache import QuantizedRaggedKVCache, RaggedKVCache
from mtplx_ext.sampling import counts_with, distribution_from_logits
from _greedy import _prompts, _rng, check_counters, check_scripted_depths
from _stats import ALPHA_EXACT, g_test_pvalue


def _model(model_type: str, seed: int, **kw):
    # Head dimension 32: one group of 32 per key row (the smallest group).
    return mtplx_ext.init_random(model_type, seed=seed, head_dim=32, **kw)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("kv_bits", [8, 4])
@pytest.mark.parametrize("B", [1, 3])
def test_greedy_mtp_equals_plain_decoding_at_the_same_kv_bits(model_type: str, kv_bits: int, B: int) -> None:
    rng = _rng()
    seed = int(rng.integers(1 << 30))
    print(f"model seed {seed}")
    rt = _model(model_type, seed, fuse_cpu_ops=True)
    prompts = _prompts(rng, rt.vocab_size, B, max_len=14)
    cap = int(rng.integers(8, 14))
    kv = dict(kv_bits=kv_bits, kv_group_size=32)
    plain = generate_greedy_batched(rt, prompts, max_new_tokens=cap, use_mtp_draft=False, **kv)
    check_counters(plain, False)
    want = [s.tokens for s in plain.streams]
    float_kv = generate_greedy_batched(rt, prompts, max_new_tokens=cap, use_mtp_draft=False)
    print("agreement with float KV:", np.mean([a == b for s, f in zip(want, float_kv.streams) for a, b in zip(s, f.tokens)]))
    runs = {1: ("mixed", "oracle", "own"), 2: ("mixed", "wrong"), 3: ("oracle", "own")}
    check_scripted_depths(rt, prompts, want, cap, runs, rng, **kv)
    # The eager loop (uncompiled steps) commits the same tokens.
    r = generate_greedy_batched(rt, prompts, max_new_tokens=cap, depth=2, enforce_eager=True, **kv)
    assert [s.tokens for s in r.streams] == want


def test_the_caches_store_quantized_kv_at_under_0_3x_and_0_17x_of_float32() -> None:
    rng = _rng()
    rt = _model("qwen3", int(rng.integers(1 << 30)))
    tokens = mx.array([rng.integers(0, rt.vocab_size, 200).tolist()])
    sizes = {}
    for bits in (None, 8, 4):
        cache = rt.make_cache([0], ragged=True, kv_bits=bits, kv_group_size=32 if bits else None)
        kinds = {type(c) for c in cache}
        assert kinds == ({RaggedKVCache} if bits is None else {QuantizedRaggedKVCache})
        rt.trunk(tokens, cache=cache)
        mx.eval([c.state for c in cache])
        sizes[bits] = sum(c.nbytes for c in cache)
    print({b: s / sizes[None] for b, s in sizes.items()})
    # float32 scales and biases per group of 32: (8 + 2) / 32 and (4 + 2) / 32 of float32's bytes.
    assert sizes[8] <= 0.32 * sizes[None] and sizes[4] <= 0.19 * sizes[None]


def test_group_64_meets_the_stated_kv_byte_ratios() -> None:
    """With mlx-lm's default group of 64: 9 / 32 (8-bit) and 5 / 32 (4-bit) of float32."""
    rng = _rng()
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), head_dim=64)
    tokens = mx.array([rng.integers(0, rt.vocab_size, 100).tolist()])
    sizes = {}
    for bits in (None, 8, 4):
        cache = rt.make_cache([0], ragged=True, kv_bits=bits)
        rt.trunk(tokens, cache=cache)
        mx.eval([c.state for c in cache])
        sizes[bits] = sum(c.nbytes for c in cache)
    assert sizes[8] <= 0.3 * sizes[None] and sizes[4] <= 0.17 * sizes[None]


def test_rolling_a_stream_back_mid_step_keeps_every_kept_slot_bit_for_bit() -> None:
    """Stream b drops its last counts[b] tokens (a partial allocation step, any count), then writes
    on: its slots equal those of a cache that only ever wrote the kept tokens."""
    rng = _rng()
    B, H, D, bits, group = 3, 2, 64, 4, 32
    first = mx.array(rng.standard_normal((B, H, 7, D)).astype(np.float32))
    more = mx.array(rng.standard_normal((B, H, 3, D)).astype(np.float32))
    counts = np.array([0, 3, 6])
    cache = QuantizedRaggedKVCache([0] * B, bits=bits, group_size=group)
    cache.update_and_fetch(first, first * 0.5)
    cache.rollback(mx.array(counts, dtype=mx.int32))
    cache.update_and_fetch(more, more * 0.5)
    for b in range(B):
        kept = 7 - counts[b]
        alone = QuantizedRaggedKVCache([0], bits=bits, group_size=group)
        alone.update_and_fetch(first[b : b + 1, :, :kept], first[b : b + 1, :, :kept] * 0.5)
        alone.update_and_fetch(more[b : b + 1], more[b : b + 1] * 0.5)
        n = kept + 3
        assert int(cache.ends[b]) == n
        for got, want in zip(cache.buffers, alone.buffers):
            assert mx.array_equal(got[b : b + 1, :, :n], want[:, :, :n]).item()
    with pytest.raises(ValueError, match="kv_group_size"):
        QuantizedRaggedKVCache([0], bits=8, group_size=128).update_and_fetch(first, first)


def test_bad_kv_arguments_are_named() -> None:
    rt = _model("qwen3", 0)
    with pytest.raises(ValueError, match="kv_bits"):
        generate_greedy_batched(rt, [[1, 2]], max_new_tokens=2, kv_bits=7, depth=1)
    with pytest.raises(ValueError, match="kv_group_size"):
        generate_greedy_batched(rt, [[1, 2]], max_new_tokens=2, kv_bits=8, kv_group_size=48, depth=1)
    with pytest.raises(ValueError, match="kv_bits"):
        mtplx_ext.Engine(rt, kv_bits=1, depth=1)
    with pytest.raises(ValueError, match="kv_bits"):
        rt.set_kv_quantization(9)


def _joint(rt, prompt: list[int], cfg: SamplerConfig, kv_bits: int) -> np.ndarray:
    """P(t1) p(t2 | t1) from full forwards of the trunk over `kv_bits` KV, in float64."""
    V = rt.vocab_size

    def last(toks: list[int]) -> np.ndarray:
        cache = rt.make_cache([0], ragged=True, kv_bits=kv_bits, kv_group_size=32)
        return np.array(rt.trunk(mx.array([toks]), cache=cache)[0, -1].astype(mx.float32), np.float64)

    p1 = distribution_from_logits(last(prompt), cfg, None)
    joint = np.zeros((V, V))
    for t1 in np.flatnonzero(p1):
        joint[t1] = p1[t1] * distribution_from_logits(last(prompt + [int(t1)]), cfg, counts_with(None, V, [t1]))
    return joint


def test_sampling_under_8_bit_kv_gives_the_models_distribution_under_8_bit_kv() -> None:
    rng = _rng()
    seed = int(rng.integers(1 << 30))
    print(f"model seed {seed}")
    cfg = SamplerConfig(temperature=3.0, top_p=0.95, presence_penalty=0.5)
    rt = _model("qwen3", seed, vocab_size=16, fuse_cpu_ops=True)
    prompt = rng.integers(0, 16, size=int(rng.integers(2, 7))).tolist()
    N = 4000
    seeds = (int(rng.integers(1 << 40)) + np.arange(N)).tolist()
    res = generate_batched(rt, [prompt] * N, max_new_tokens=2, sampler=cfg, row_seeds=seeds, kv_bits=8,
                           kv_group_size=32, depth=1)
    pairs = np.array([s.tokens for s in res.streams])
    joint = _joint(rt, prompt, cfg, 8)
    p = g_test_pvalue(np.bincount(pairs[:, 0] * 16 + pairs[:, 1], minlength=256), joint.reshape(-1))
    assert p >= ALPHA_EXACT, f"8-bit KV MTP sampling off the model's distribution: p = {p:.2e}"
