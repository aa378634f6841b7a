"""Prefix cache: a later prompt that starts like an earlier prompt (or prompt + reply) reuses its KV,
decodes what it would without the cache, and prefills only the rest."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine
from mtplx_ext.batching.prefix_blocks import Node
from _greedy import check_stream, reference

MB = 1 << 20


def _run(eng: Engine, *submits):
    reqs = [eng.submit(p, **kw) for p, kw in submits]
    eng.run_until_idle()
    assert all(r.finish_reason in ("stop", "length") for r in reqs), [r.error for r in reqs]
    return reqs


def _prefilled(eng: Engine) -> int:
    return eng.metrics()["prefill_tokens"]


@pytest.mark.parametrize("depth,mtp", [(2, True), (1, False)])
def test_a_second_turn_reuses_the_first_turns_kv_and_decodes_the_same(shipped, rng, depth, mtp):
    eng = Engine(shipped, max_batch=2, depth=depth, use_mtp=mtp, prefill_chunk=32, prefix_cache_bytes=64 * MB)
    V = shipped.vocab_size
    system = rng.integers(0, V, 60).tolist()
    (first,) = _run(eng, (system, dict(max_tokens=20)))
    # The next turn: the whole conversation so far plus a new message.
    turn = system + first.tokens + rng.integers(0, V, 9).tolist()
    before = _prefilled(eng)
    (second,) = _run(eng, (turn, dict(max_tokens=24)))
    ref, gaps = reference(shipped, turn, 24)
    check_stream(0, second, ref, gaps, set(), 24)
    m = eng.metrics()
    assert m["prefix_hits"] == 1 and m["prefix_tokens_reused"] >= len(system) + len(first.tokens) - 1
    # Only the new tail was prefilled.
    assert _prefilled(eng) - before == len(turn) - m["prefix_tokens_reused"] <= 10
    assert m["live_streams"] == 0 and m["kv_slots"] == 0


def test_a_broken_resume_is_caught_by_the_same_comparison(shipped, rng, monkeypatch):
    """Loading only part of the prefix the resumed prefill assumes gives other tokens."""
    from mtplx_ext.batching import prefix_cache

    real = prefix_cache.PrefixCache.load

    def half(plan, cache_lists, capacity):
        # Positions m // 2..m - 1 missing; the forward resumes at m.
        real(prefix_cache.Plan(plan.nodes, plan.m // 2, plan.state), cache_lists, capacity)

    monkeypatch.setattr(prefix_cache.PrefixCache, "load", staticmethod(half))
    eng = Engine(shipped, max_batch=1, depth=2, prefix_cache_bytes=64 * MB)
    V = shipped.vocab_size
    bad = 0
    for _ in range(4):
        base = rng.integers(0, V, 40).tolist()
        _run(eng, (base, dict(max_tokens=4)))
        turn = base + rng.integers(0, V, 5).tolist()
        (r,) = _run(eng, (turn, dict(max_tokens=16)))
        bad += r.tokens != reference(shipped, turn, 16)[0]
    assert bad > 0


def test_sampled_requests_sharing_a_prefix_at_once_equal_their_alone_tokens(shipped, rng):
    V = shipped.vocab_size
    shared = rng.integers(0, V, 50).tolist()
    prompts = [shared + rng.integers(0, V, int(n)).tolist() for n in (3, 7, 5)]
    kws = [dict(max_tokens=16, sampler=SamplerConfig(temperature=1.0, top_p=0.9), seed=int(s))
           for s in rng.integers(0, 2**31, 3)]
    alone = [mtplx_ext.generate_batched(shipped, [p], max_new_tokens=16, sampler=kw["sampler"],
                                        row_seeds=[kw["seed"]], depth=2).streams[0].tokens
             for p, kw in zip(prompts, kws)]
    eng = Engine(shipped, max_batch=3, depth=2, prefix_cache_bytes=64 * MB)
    _run(eng, (shared, dict(max_tokens=2)))  # stores the shared prefix
    got = _run(eng, *zip(prompts, kws))
    assert eng.metrics()["prefix_hits"] >= 3
    assert [r.tokens for r in got] == alone


def test_blocks_are_evicted_least_recently_used_within_the_cap(shipped, rng):
    V = shipped.vocab_size
    eng = Engine(shipped, max_batch=1, depth=1, prefix_cache_bytes=1)  # room for nothing
    _run(eng, (rng.integers(0, V, 40).tolist(), dict(max_tokens=2)))
    assert eng.metrics()["prefix_entries"] == 0 and eng.metrics()["prefix_bytes"] == 0
    probe = Engine(shipped, max_batch=1, depth=1, prefix_cache_bytes=64 * MB)
    _run(probe, (rng.integers(0, V, 40).tolist(), dict(max_tokens=1)))  # one prompt's blocks
    per_prompt = probe.metrics()["prefix_bytes"]
    cap = int(per_prompt * 2.5)
    eng = Engine(shipped, max_batch=1, depth=1, prefix_cache_bytes=cap)
    prompts = [rng.integers(0, V, 40).tolist() for _ in range(3)]
    for p in prompts:
        _run(eng, (p, dict(max_tokens=1)))
    m = eng.metrics()
    assert m["prefix_bytes"] <= cap and m["prefix_evictions"] > 0
    before = _prefilled(eng)
    _run(eng, (prompts[0] + [1, 2, 3], dict(max_tokens=1)))  # the oldest is (partly) gone: more to prefill
    oldest = _prefilled(eng) - before
    before = _prefilled(eng)
    _run(eng, (prompts[2] + [1, 2, 3], dict(max_tokens=1)))  # the newest is all there
    assert _prefilled(eng) - before <= 4 < oldest  # (3 when token 1 is the first token it decoded)


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_a_resumed_turn_over_quantized_kv_decodes_what_plain_decoding_at_those_bits_does(shipped, rng, kv_bits):
    """The entry stores the quantized parts as the caches hold them; loading them resumes exactly."""
    eng = Engine(shipped, max_batch=2, depth=2, prefill_chunk=32, prefix_cache_bytes=64 * MB, kv_bits=kv_bits)
    V = shipped.vocab_size
    system = rng.integers(0, V, 50).tolist()
    (first,) = _run(eng, (system, dict(max_tokens=12)))
    turn = system + first.tokens + rng.integers(0, V, 7).tolist()
    (second,) = _run(eng, (turn, dict(max_tokens=20)))
    assert eng.metrics()["prefix_hits"] == 1
    want = mtplx_ext.generate_greedy_batched(shipped, [turn], max_new_tokens=20, use_mtp_draft=False, kv_bits=kv_bits)
    assert second.tokens == want.streams[0].tokens
    nodes = [n for n in eng.prefix.ram.items.values() if isinstance(n, Node)]
    assert nodes and all(len(parts) == 6 and parts[0].dtype == mx.uint32 for n in nodes for parts in n.kv)
