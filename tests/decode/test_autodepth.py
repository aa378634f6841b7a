"""depth="auto": the choice is measured and cached, decodes the same tokens as every fixed depth,
and picks (within simulation noise) the depth a simulated decode finds fastest."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.decode import autodepth, generate
from mtplx_ext.decode.autodepth import DepthCosts, choose_depth, expected_tokens
from _greedy import check_stream, reference
from _playout import play, simulated_tokens_per_s


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """Every test calibrates into its own folder, from an empty memory."""
    monkeypatch.setenv("MTPLX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autodepth, "_MEMORY", {})


def _random_costs(rng, batch: int) -> tuple[DepthCosts, list[float]]:
    plain = float(rng.uniform(0.001, 0.2))
    slope = float(rng.uniform(0.0, 1.5))  # verification + head cost per extra draft, in plain steps
    # A cycle at K does what one at K - 1 does and more: costs rise with K (`autodepth.cycle_cost`).
    steps = np.cumsum(rng.uniform(0, 0.4 / 5, size=5))
    cycle = {"0": plain, **{str(k): plain * (1 + float(steps[k - 1]) + slope * k) for k in range(1, 6)}}
    acc = [float(a) for a in rng.uniform(0.2, 0.98, 5)]
    return DepthCosts(batch=batch, cycle_s=cycle, acceptance=acc), acc


def test_the_chosen_depth_is_as_fast_as_the_best_simulated_one(rng):
    naive_loses = 0
    for _ in range(40):
        costs, acc = _random_costs(rng, int(rng.integers(1, 9)))
        sim = {k: simulated_tokens_per_s(costs, acc, k, rng) for k in range(6)}
        best = max(sim.values())
        assert sim[choose_depth(costs)] >= 0.95 * best, (costs, sim)
        # A broken picker (always the deepest, ignoring cost) is caught by the same check.
        naive_loses += sim[5] < 0.95 * best
    assert naive_loses > 0


def test_plain_decoding_is_chosen_where_mtp_would_lose():
    costs = DepthCosts(batch=8, cycle_s={"0": 1.0, "1": 2.2, "2": 3.0, "3": 3.9}, acceptance=[0.9, 0.9, 0.9])
    assert choose_depth(costs) == 0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)


def test_a_deep_cycle_measured_cheaper_than_a_shallower_one_counts_as_the_shallower_ones_cost(rng):
    # The batch-8 calibration of the shipped model once read K = 4 and 5 below K = 3 (noise): at face value
    # K = 5 beat plain decoding by 5 %; with each cost raised to the dearest shallower depth's, plain wins.
    acc = [0.8, 0.77, 0.89, 0.75, 0.82]
    noisy = DepthCosts(batch=8, cycle_s={"0": 2.455e-3, "1": 4.644e-3, "2": 6.468e-3, "3": 9.528e-3, "4": 8.717e-3,
                                         "5": 8.658e-3}, acceptance=acc)
    assert [autodepth.cycle_cost(noisy, k) for k in range(6)] == [2.455e-3, 4.644e-3, 6.468e-3] + [9.528e-3] * 3
    assert autodepth.choose_depth(noisy) == 0
    # Costs that rise with K are taken as measured.
    rising = sorted(rng.uniform(1e-3, 1e-2, size=6))
    costs = DepthCosts(batch=1, cycle_s={str(k): t for k, t in enumerate(rising)}, acceptance=[0.9] * 5)
    assert [autodepth.cycle_cost(costs, k) for k in range(6)] == list(rising)


def test_auto_calibrates_once_per_model_and_batch_then_reads_its_cache(shipped, monkeypatch):
    calls = []
    real = autodepth.calibrate

    def counting(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(autodepth, "calibrate", counting)
    k1 = generate.auto_depth(shipped, 1)
    assert generate.auto_depth(shipped, 1) == k1 and calls == [1]  # memory
    monkeypatch.setattr(autodepth, "_MEMORY", {})
    assert generate.auto_depth(shipped, 1) == k1 and calls == [1]  # the cache file
    generate.auto_depth(shipped, 3)
    assert calls == [1, 3]  # another batch size is measured
    assert 0 <= k1 <= autodepth.MAX_AUTO_DEPTH


def test_greedy_tokens_do_not_depend_on_the_depth(shipped, rng):
    prompts = [rng.integers(0, shipped.vocab_size, int(n)).tolist() for n in (3, 11, 7)]
    n = 24
    refs = [reference(shipped, p, n) for p in prompts]
    for depth, mtp in [(1, False), (1, True), (2, True), (3, True), (5, True), ("auto", True)]:
        res = mtplx_ext.generate_greedy_batched(shipped, prompts, max_new_tokens=n, depth=depth, use_mtp_draft=mtp)
        for i, (s, (ref, gaps)) in enumerate(zip(res.streams, refs)):
            check_stream(i, s, ref, gaps, set(), n)


def test_the_engine_and_generate_follow_the_measured_choice(shipped, monkeypatch):
    table = {}

    def fake(runtime, batch, decode, max_depth=autodepth.MAX_AUTO_DEPTH):
        return table[batch]

    monkeypatch.setattr(autodepth, "depth_costs", fake)
    for b in (1, 2, 4):  # drafting pays at no batch size: a plain engine
        table[b] = DepthCosts(batch=b, cycle_s={"0": 1.0, "1": 5.0, "2": 6.0}, acceptance=[0.9, 0.9])
    eng = mtplx_ext.Engine(shipped, max_batch=4, depth="auto")
    assert not eng.mtp and eng.metrics()["depth"] == 0
    table[2] = DepthCosts(batch=2, cycle_s={"0": 1.0, "1": 1.0, "2": 1.05}, acceptance=[0.9, 0.9])
    table[1] = DepthCosts(batch=1, cycle_s={"0": 1.0, "1": 3.0, "2": 4.0}, acceptance=[0.9, 0.9])  # plain: K = 0
    eng = mtplx_ext.Engine(shipped, max_batch=2, depth="auto")
    assert eng.mtp and eng.depth == 2 and eng._depths.depths == {1: 0, 2: 2}
    res = mtplx_ext.generate_greedy_batched(shipped, [[1, 2], [3]], max_new_tokens=8, depth="auto")
    assert res.depth == 2
    table[2] = DepthCosts(batch=2, cycle_s={"0": 1.0, "1": 3.0, "2": 4.0}, acceptance=[0.9, 0.9])
    res = mtplx_ext.generate_greedy_batched(shipped, [[1, 2], [3]], max_new_tokens=8, depth="auto")
    assert res.depth == 0 and res.drafted == 0


def _costs_choosing(batch: int, k: int) -> DepthCosts:
    """Costs whose best depth is k (high acceptance; depths past k cost far more)."""
    cycle = {str(d): 1.0 + 0.05 * d if d <= k else 10.0 * d for d in range(6)}
    return DepthCosts(batch=batch, cycle_s=cycle, acceptance=[0.9] * 5)


def test_the_engine_runs_each_batch_size_at_its_own_auto_depth_and_stays_lossless(shipped, rng, monkeypatch):
    """K follows the batch size (4 rows: K = 1, 2: K = 2, 1: K = 4); rows keep or pad their drafts."""
    want = {1: 4, 2: 2, 4: 1}
    monkeypatch.setattr(autodepth, "depth_costs", lambda rt, batch, decode, max_depth=5: _costs_choosing(batch, want[batch]))
    eng = mtplx_ext.Engine(shipped, max_batch=4, depth="auto", prefill_chunk=16)
    assert eng._depths.depths == want and eng.depth == 5  # the deepest K calibrated: what a batch may run
    eng._depths.recent = deque(maxlen=1)  # K follows each batch's own size (the window: below)
    eng._depths.running = None  # and not the acceptance (tests/batching/test_depths.py)
    sizes: deque = deque(maxlen=1)
    recompositions = 0
    prompts = [rng.integers(0, shipped.vocab_size, size=int(rng.integers(2, 30))).tolist() for _ in range(6)]
    caps = [int(rng.integers(6, 30)) for _ in prompts]
    caps[0] = int(rng.integers(48, 60))  # still decoding when the next three are prefilled: a batch of 4
    refs = [reference(shipped, p, n) for p, n in zip(prompts, caps)]
    seen = set()
    with eng.session():
        reqs = [eng.submit(prompts[0], max_tokens=caps[0])]
        for step in range(3000):
            if step == 3:  # three more join the first: a batch of 4, then halved as they finish
                reqs += [eng.submit(p, max_tokens=n) for p, n in zip(prompts[1:4], caps[1:4])]
            if step == 12:
                reqs += [eng.submit(p, max_tokens=n) for p, n in zip(prompts[4:], caps[4:])]
            busy = eng.step()
            if eng.counters["recompositions"] > recompositions and eng.batch_rows:
                recompositions = eng.counters["recompositions"]
                sizes.append(eng.batch_rows)
                assert eng.cycle_depth == want[min(b for b in want if b >= max(sizes))], (list(sizes), eng.cycle_depth)
                seen.add(eng.cycle_depth)
            if not busy and step > 12:
                break
    assert seen >= {1, 4}, seen
    for i, (r, (ref, gaps), n) in enumerate(zip(reqs, refs, caps)):
        assert r.error is None
        check_stream(i, r, ref, gaps, set(), n)


def test_sampled_rows_survive_changes_of_k(shipped, rng, monkeypatch):
    """Sampled rows moving between batch sizes (K = 4 alone, K = 1 at 4 rows) keep decoding to their caps."""
    want = {1: 4, 2: 2, 4: 1}
    monkeypatch.setattr(autodepth, "depth_costs", lambda rt, batch, decode, max_depth=5: _costs_choosing(batch, want[batch]))
    eng = mtplx_ext.Engine(shipped, max_batch=4, depth="auto", prefill_chunk=16)
    cfg = mtplx_ext.SamplerConfig(temperature=0.8, top_p=0.95)
    with eng.session():
        reqs = [eng.submit(rng.integers(0, shipped.vocab_size, 8).tolist(), max_tokens=24, sampler=cfg, seed=1)]
        for _ in range(4):
            eng.step()
        reqs += [eng.submit(rng.integers(0, shipped.vocab_size, 5).tolist(), max_tokens=int(n), sampler=cfg, seed=int(s))
                 for n, s in zip(rng.integers(4, 20, 3), rng.integers(0, 2**31, 3))]
        eng.run_until_idle()
    for r in reqs:
        assert r.error is None and r.finish_reason in ("stop", "length")
        assert 0 < len(r.tokens) <= r.max_tokens and all(0 <= t < shipped.vocab_size for t in r.tokens)


def test_the_depth_follows_the_largest_recent_batch_size(rng):
    """Under steady load K stays the full batch's; once the batch stays small the deeper K takes over."""
    from mtplx_ext.batching.depths import RECENT_BATCHES, RECENT_CYCLES, BatchDepths

    want = {1: 5, 2: 4, 4: 3, 8: 2}
    d = BatchDepths(want)
    sizes = [int(s) for s in rng.integers(1, 9, size=40)]
    for i, n in enumerate(sizes):
        top = max(sizes[max(0, i + 1 - RECENT_BATCHES) : i + 1])
        assert d(n) == want[min(b for b in want if b >= top)]
    assert [d(1) for _ in range(RECENT_BATCHES)][-1] == 5  # a run of one-row batches: K = 5 again
    assert d(12) == 2  # beyond the largest calibrated size: its K
    # A full batch, then one stream decoding on: its deep K once the full batch is RECENT_CYCLES cycles back,
    # not only after RECENT_BATCHES more batches.
    assert d(8) == 2 and d(1) == 2
    for cycle in range(RECENT_CYCLES + 1):
        d.observe([0] * 5, [0] * 5, 1, d.expected(1))
        assert d.expected(1) == (2 if cycle < RECENT_CYCLES else 5), cycle
    assert d(1) == 5


def test_the_running_acceptance_starts_at_the_calibration_and_follows_what_decoding_sees(rng):
    prior = [float(a) for a in rng.uniform(0.3, 0.95, 4)]
    run = autodepth.RunningAcceptance(prior)
    assert run.estimate() == pytest.approx(prior)
    true = [float(a) for a in rng.uniform(0.05, 0.95, 2)]
    totals = ([0, 0], [0, 0])
    for _ in range(30):  # the engine reports running totals after every cycle; here every 20 stream-cycles
        play(*totals, 20, 2, true, rng)
        run.observe(*totals)
    est = run.estimate()
    # Draft 1 (reached every cycle): near the truth over a window of about 2 x HALF_LIFE stream-cycles;
    # positions depth 2 never reaches: the calibration's, scaled as draft 2's estimate moved from its own.
    assert abs(est[0] - true[0]) < 0.2
    assert est[2] == pytest.approx(min(1.0, prior[2] * est[1] / prior[1]))
    assert est[3] == pytest.approx(min(1.0, prior[3] * est[2] / prior[2]))
    # A workload that changes: after 5 half-lives at a new rate the estimate is there; totals that never
    # decay (the broken variant) are still far from it.
    follows = autodepth.RunningAcceptance(prior)
    frozen = autodepth.RunningAcceptance(prior, half_life=float("inf"))
    totals = ([0, 0], [0, 0])
    for rate, n in ((0.05, int(8 * autodepth.HALF_LIFE)), (0.95, int(5 * autodepth.HALF_LIFE))):
        for _ in range(n // 10):
            play(*totals, 10, 2, [rate, rate], rng)
            follows.observe(*totals)
            frozen.observe(*totals)
    assert follows.estimate()[0] > 0.8 and frozen.estimate()[0] < 0.5
