"""Prefix cache in shared blocks, on every trunk and head: hybrid (GatedDeltaNet) trunks resume from a stored
recurrent state, heads of several MTP modules from their stored carries, and a resumed turn decodes what a
cold one does; overlapping prompts store their common blocks once."""

from __future__ import annotations

from pathlib import Path

import pytest

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine, prefix_cache
from mtplx_ext.batching.prefix_blocks import Node, State
from mtplx_ext.cache.rows import split_layers
from _greedy import check_stream, reference

MB = 1 << 20
#: Logprob difference a resumed prefill may show against a cold one (other chunking, same math); a state one
#: position off moves the bench model's logprobs by about 1e-2.
LOGPROB_TOL = 2e-3
HYBRID = Path(__file__).resolve().parents[2] / "bench" / "models" / "tiny-qwen3-next-mtp"


@pytest.fixture(scope="module")
def hybrid():
    """The hybrid bench model (qwen3_next: GatedDeltaNet and attention layers, one MTP module)."""
    return mtplx_ext.load(HYBRID)


def _random(family: str, modules: int):
    rt = mtplx_ext.init_random(family, seed=7 + modules, num_nextn_predict_layers=modules,
                               mtp_num_hidden_layers=modules)
    assert len(rt.mtp_modules) == modules
    return rt


PAIR = Path(__file__).resolve().parents[2] / "bench" / "models" / "tiny-gemma4-pair"

#: (name, runtime maker): a trained hybrid, random trunks with heads of one and two modules, a Gemma 4 target
#: with its assistant (a frozen-KV drafter: nothing of its own to store).
MODELS = {
    "hybrid-bench": None,
    "gemma4-pair": lambda: mtplx_ext.load(PAIR / "target", drafter=PAIR / "assistant"),
    "qwen3-2-modules": lambda: _random("qwen3", 2),
    "qwen3_5-2-modules": lambda: _random("qwen3_5", 2),
    "qwen3_next-1-module": lambda: _random("qwen3_next", 1),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, hybrid):
    make = MODELS[request.param]
    return hybrid if make is None else make()


def _run(eng: Engine, prompt, **kw):
    r = eng.submit(prompt, **kw)
    eng.run_until_idle()
    assert r.finish_reason in ("stop", "length"), r.error
    return r


def _conversation(eng: Engine, rng, turns: int, V: int, system: int = 45, message: int = 9, reply: int = 10):
    """Turns that each resend the conversation plus a new message; (prompt, request) per turn."""
    history = rng.integers(0, V, system).tolist()
    out = []
    for _ in range(turns):
        prompt = history + rng.integers(0, V, message).tolist()
        r = _run(eng, prompt, max_tokens=reply)
        out.append((prompt, r))
        history = prompt + r.tokens
    return out


def test_resumed_turns_decode_what_mlx_lm_does(model, rng):
    eng = Engine(model, max_batch=1, depth=2, prefill_chunk=32, prefix_cache_bytes=64 * MB, prefix_block_tokens=16)
    turns = _conversation(eng, rng, 3, model.vocab_size)
    m = eng.metrics()
    assert m["prefix_hits"] == 2, m
    # Each later turn resumed at least at the end of the turn before's prompt (its stored state).
    assert m["prefix_tokens_reused"] >= len(turns[0][0]) + len(turns[1][0])
    assert m["prefill_tokens"] <= len(turns[0][0]) + 2 * (9 + 10 + 1)
    for i, (prompt, r) in enumerate(turns):
        ref, gaps = reference(model, prompt, 10)
        check_stream(i, r, ref, gaps, set(), 10)


@pytest.mark.parametrize("family_modules", [("hybrid", 1), ("qwen3_5", 2)])
def test_a_resumed_sampled_turn_equals_a_cold_one_with_the_same_seed(hybrid, rng, family_modules):
    family, modules = family_modules
    rt = hybrid if family == "hybrid" else _random(family, modules)
    V = rt.vocab_size
    first = rng.integers(0, V, 70).tolist()
    kw = dict(max_tokens=12, sampler=SamplerConfig(temperature=1.0, top_p=0.95))
    warm = Engine(rt, max_batch=1, depth=2, prefix_cache_bytes=64 * MB, prefix_block_tokens=16)
    r1 = _run(warm, first, seed=1, **kw)
    turn = first + r1.tokens + rng.integers(0, V, 11).tolist()
    seed = int(rng.integers(0, 2**31))
    got = _run(warm, turn, seed=seed, **kw).tokens
    assert warm.metrics()["prefix_hits"] == 1 and warm.metrics()["prefix_tokens_reused"] >= len(first)
    cold = _run(Engine(rt, max_batch=1, depth=2), turn, seed=seed, **kw).tokens
    assert got == cold


def test_a_state_loaded_one_position_off_is_caught(hybrid, rng, monkeypatch):
    """The recurrent state of boundary m, but the resume one position earlier (the KV and positions at m - 1):
    the GatedDeltaNet layers then see token m - 1 twice, and the comparison with a cold engine rejects it."""
    real = prefix_cache.PrefixCache.load

    def off_by_one(self, prompt, cache_lists, capacity):
        plan = self.lookup(prompt, cache_lists)
        if plan is None:
            return 0
        real(plan, cache_lists, capacity)
        for p in split_layers(cache_lists)[0]:
            p.load(p.ends - 1, p.last_slot)
        return plan.m - 1

    monkeypatch.setattr(prefix_cache.PrefixCache, "resume", off_by_one)
    assert not _resumed_turns_match_cold_ones(hybrid, rng)


def _resumed_turns_match_cold_ones(rt, rng, trials: int = 3) -> bool:
    """Whether second turns resumed from the cache give a cold engine's tokens and logprobs (to LOGPROB_TOL)."""
    eng = Engine(rt, max_batch=1, depth=2, prefix_cache_bytes=64 * MB, prefix_block_tokens=16)
    V, same = rt.vocab_size, True
    for _ in range(trials):
        base = rng.integers(0, V, 40).tolist()
        first = _run(eng, base, max_tokens=3)
        turn = base + first.tokens + rng.integers(0, V, 5).tolist()
        r = _run(eng, turn, max_tokens=8, logprobs=0)
        cold = _run(Engine(rt, max_batch=1, depth=2), turn, max_tokens=8, logprobs=0)
        gap = max(abs(a[0] - b[0]) for a, b in zip(r.token_logprobs, cold.token_logprobs))
        same &= r.tokens == cold.tokens and gap < LOGPROB_TOL
    assert eng.metrics()["prefix_hits"] == trials
    return same


def test_resumed_turns_give_a_cold_engines_logprobs(hybrid, rng):
    """The same comparison as the broken variant's, on the real cache: it passes."""
    assert _resumed_turns_match_cold_ones(hybrid, rng)


def _stored(rt, prompts, block):
    eng = Engine(rt, max_batch=1, depth=2, prefix_cache_bytes=64 * MB, prefix_block_tokens=block)
    for p in prompts:
        _run(eng, p, max_tokens=1)  # the prompt's blocks (and its state), no reply
    return eng


@pytest.mark.parametrize("which", ["hybrid", "attention"])
def test_two_conversations_store_their_common_blocks_once(hybrid, shipped, rng, which):
    rt = hybrid if which == "hybrid" else shipped
    V, B = rt.vocab_size, 16
    system = rng.integers(0, V, 100).tolist()
    a = system + rng.integers(0, V, 30).tolist()
    b = system + rng.integers(0, V, 27).tolist()
    while b[len(system)] == a[len(system)]:
        b[len(system)] = int(rng.integers(0, V))
    alone_a, alone_b, both = _stored(rt, [a], B), _stored(rt, [b], B), _stored(rt, [a, b], B)
    node = next(n for n in both.prefix.ram.items.values() if isinstance(n, Node) and n.slots == B)
    shared = (len(system) - 1) // B  # full blocks whose B + 1 tokens are all the system prompt's
    bytes_ = lambda e: e.metrics()["prefix_bytes"]  # noqa: E731
    assert bytes_(both) == bytes_(alone_a) + bytes_(alone_b) - shared * node.nbytes
    assert both.metrics()["prefix_entries"] == alone_a.metrics()["prefix_entries"] + \
        alone_b.metrics()["prefix_entries"] - shared
    states = [s for s in both.prefix.ram.items.values() if isinstance(s, State)]
    assert len(states) == (2 if which == "hybrid" else 0)


def test_a_conversation_keeps_about_one_copy_of_its_last_prompt(hybrid, rng):
    """Ten turns store overlapping prompts and replies; the blocks are shared and earlier states thinned,
    so the cache holds little more than the last prompt's KV plus a few states."""
    eng = Engine(hybrid, max_batch=1, depth=2, prefix_cache_bytes=256 * MB, prefix_block_tokens=16)
    turns = _conversation(eng, rng, 10, hybrid.vocab_size, system=40, message=20, reply=6)
    items = list(eng.prefix.ram.items.values())
    node = next(n for n in items if isinstance(n, Node))
    per_slot = node.nbytes / node.slots
    kv = sum(n.nbytes for n in items if isinstance(n, Node))
    last = turns[-1][0]
    assert kv <= 1.15 * per_slot * (len(last) + 6)
    states = [s for s in items if isinstance(s, State)]
    assert 1 <= len(states) <= 2  # the newest (prompt or reply end); the ladder keeps older ones 1024 apart
    assert eng.metrics()["prefix_hits"] == 9


def test_a_prompt_sharing_only_a_long_system_prompt_resumes_from_a_rung_inside_it(hybrid, rng):
    """A cold prefill keeps a state every `state_interval` tokens: another conversation with the same
    system prompt resumes from the last one inside it, and decodes what mlx-lm does."""
    V = hybrid.vocab_size
    eng = Engine(hybrid, max_batch=1, depth=2, prefill_chunk=32, prefix_cache_bytes=64 * MB, prefix_block_tokens=16)
    eng.prefix.ram.state_interval = 64
    system = rng.integers(0, V, 150).tolist()
    _run(eng, system + rng.integers(0, V, 10).tolist(), max_tokens=2)
    other = system + rng.integers(0, V, 12).tolist()
    r = _run(eng, other, max_tokens=10)
    m = eng.metrics()
    assert m["prefix_hits"] == 1 and m["prefix_tokens_reused"] == 128
    ref, gaps = reference(hybrid, other, 10)
    check_stream(0, r, ref, gaps, set(), 10)
