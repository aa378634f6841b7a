"""Requests arriving together prefill in one left-padded forward (`batching.prefill`) and decode as if alone.

Prompts of different lengths make every row's padding differ, so a row
whose slots were not moved back to 0 (the broken variant: the padded rows
taken as they are) reads other keys than its own and is caught by the same
check.
"""

from __future__ import annotations

import numpy as np
import pytest
from _engine import KeyedHead, drive, random_prompt, sampled_arrivals
from _greedy import _runtime, check_stream, reference

import mtplx_ext
from mtplx_ext.batching import Engine, prefill
from mtplx_ext.cache.ragged import RaggedPositions
from mtplx_ext.shipped import SHIPPED_MODEL


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED_MODEL)


def _groups(monkeypatch) -> list[int]:
    """Counts the rows of each group prefill the engine runs."""
    sizes: list[int] = []
    real = prefill.group_cycle

    def spy(runtime, reqs, *a, **k):
        sizes.append(len(reqs))
        return real(runtime, reqs, *a, **k)

    monkeypatch.setattr(prefill, "group_cycle", spy)
    return sizes


def _greedy_case(rt, rng, n: int, mtp: bool):
    prompts = [random_prompt(rng, rt, 1, 24) for _ in range(n)]
    while len({len(p) for p in prompts}) < 2:  # (different paddings)
        prompts[0] = random_prompt(rng, rt, 1, 24)
    caps = [int(rng.integers(2, 10)) for _ in range(n)]
    refs = [reference(rt, p, c) for p, c in zip(prompts, caps)]
    model = KeyedHead(rt, [p + ref for p, (ref, _) in zip(prompts, refs)], rng) if mtp else rt
    return prompts, caps, refs, model


def _run_greedy(model, prompts, caps, depth, mtp):
    eng = Engine(model, max_batch=len(prompts), depth=depth, use_mtp=mtp, prefill_chunk=256)
    reqs = drive(eng, [(0, dict(prompt=p, max_tokens=c)) for p, c in zip(prompts, caps)])
    assert eng.live_streams == 0 and eng.kv_slots == 0
    return reqs


@pytest.mark.parametrize("family", ["shipped", "qwen3_next"])
@pytest.mark.parametrize("depth,mtp", [(2, True), (1, False)])
def test_greedy_requests_prefilled_together_equal_mlx_lm_decoding_of_each_prompt_alone(
        shipped, rng, monkeypatch, family, depth, mtp):
    rt = shipped if family == "shipped" else _runtime(family, rng)
    prompts, caps, refs, model = _greedy_case(rt, rng, 4, mtp)
    sizes = _groups(monkeypatch)
    reqs = _run_greedy(model, prompts, caps, depth, mtp)
    assert sizes == [4], "the four requests arriving together prefill in one forward"
    for i, (r, (ref, gaps), cap) in enumerate(zip(reqs, refs, caps)):
        assert r.error is None and r.finish_reason == "length"
        check_stream(i, r, ref, gaps, set(), cap)


def test_the_same_check_rejects_group_rows_left_padded(shipped, rng, monkeypatch):
    # The broken variant: each row keeps its padding slots (the prefill's rows not kept at slot 0, taken as they
    # are by a batch whose rows start at slot 0).
    prompts, caps, refs, model = _greedy_case(shipped, rng, 5, True)
    monkeypatch.setattr(RaggedPositions, "move_rows_left", lambda self, pads: None)
    reqs = _run_greedy(model, prompts, caps, 2, True)
    wrong = 0
    for i, (r, (ref, gaps), cap) in enumerate(zip(reqs, refs, caps)):
        try:
            check_stream(i, r, ref, gaps, set(), cap)
        except AssertionError:
            wrong += 1
    assert wrong > 0, "rows read at their padded slots went unnoticed"


def test_seeded_sampled_requests_prefilled_together_give_their_alone_tokens(shipped, rng, monkeypatch):
    kws = [kw for kw in sampled_arrivals(rng, shipped, 9) if not kw["sampler"].greedy][:5]
    alone = [
        mtplx_ext.generate_batched(shipped, [kw["prompt"]], max_new_tokens=kw["max_tokens"], sampler=kw["sampler"],
                                   row_seeds=[kw["seed"]], depth=2).streams[0].tokens
        for kw in kws
    ]
    sizes = _groups(monkeypatch)
    eng = Engine(shipped, max_batch=len(kws), depth=2, prefill_chunk=256)
    got = drive(eng, [(0, kw) for kw in kws])
    assert sizes == [len(kws)]
    assert [r.tokens for r in got] == alone


def test_a_prefix_cache_hit_in_a_group_prefills_alone_from_its_hit(shipped, rng, monkeypatch):
    base = random_prompt(rng, shipped, 20, 24)
    first = Engine(shipped, max_batch=4, depth=2, prefill_chunk=256, prefix_cache_bytes=64 << 20)
    drive(first, [(0, dict(prompt=base, max_tokens=4))])
    others = [random_prompt(rng, shipped, 3, 12) for _ in range(2)]
    prompts = [base + [int(t) for t in np.asarray(random_prompt(rng, shipped, 2, 4))]] + others
    refs = [reference(shipped, p, 6) for p in prompts]
    sizes = _groups(monkeypatch)
    reqs = drive(first, [(0, dict(prompt=p, max_tokens=6)) for p in prompts])
    assert first.metrics()["prefix_hits"] >= 1
    assert sizes == [2], "the hit goes alone, the two others together"
    for i, (r, (ref, gaps)) in enumerate(zip(reqs, refs)):
        check_stream(i, r, ref, gaps, set(), 6)


def test_quantized_kv_rows_prefilled_together_equal_each_request_prefilled_alone(shipped, rng, monkeypatch):
    # Every packed part of a quantized KV layer (values, scales, biases) moves with its row.
    prompts = [random_prompt(rng, shipped, 1, 40) for _ in range(4)]
    alone = []
    for p in prompts:
        eng = Engine(shipped, max_batch=1, depth=2, prefill_chunk=256, kv_bits=8)
        alone.append(drive(eng, [(0, dict(prompt=p, max_tokens=10))])[0].tokens)
    sizes = _groups(monkeypatch)
    eng = Engine(shipped, max_batch=4, depth=2, prefill_chunk=256, kv_bits=8)
    got = drive(eng, [(0, dict(prompt=p, max_tokens=10)) for p in prompts])
    assert sizes == [4]
    assert [r.tokens for r in got] == alone


def test_moving_rows_left_is_refused_without_a_capacity_after_a_forward_or_past_a_rows_padding():
    with pytest.raises(ValueError, match="fixed-capacity"):
        RaggedPositions([1, 0]).move_rows_left([1, 0])
    p = RaggedPositions([2, 0], capacity=8)
    with pytest.raises(ValueError, match="at most its left padding"):
        p.move_rows_left([3, 0])
    p.move_rows_left([2, 0])
    assert np.array(p.ends).tolist() == [-2, 0] and np.array(p.left_padding).tolist() == [0, 0]
    p.apply("forward", 3)  # the padding's two writes go to the last slot; row 0's token to slot 0
    _, write, offsets = p.last_forward
    assert np.array(write)[:, 0, :, 0].tolist() == [[7, 7, 0], [0, 1, 2]]
    assert np.array(offsets).tolist() == [-2, 0]
    with pytest.raises(ValueError, match="before their first forward"):
        p.move_rows_left([0, 0])
