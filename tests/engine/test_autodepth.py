"""depth="auto": the choice is measured and cached, decodes the same tokens as every fixed depth,
and picks (within simulation noise) the depth a simulated decode finds fastest."""

from __future__ import annotations

import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.engine import autodepth, generate
from mtplx_ext.engine.autodepth import DepthCosts, choose_depth, expected_tokens
from _greedy import check_stream, reference


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """Every test calibrates into its own folder, from an empty memory."""
    monkeypatch.setenv("MTPLX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autodepth, "_MEMORY", {})


def _simulated_tokens_per_s(costs: DepthCosts, acc: list[float], K: int, rng, cycles: int = 4000) -> float:
    """A decode played out: each cycle accepts drafts while Bernoulli(a_j) succeeds, then commits one more."""
    if K == 0:
        return costs.batch / costs.cycle_s["0"]
    u = rng.random((cycles, K))
    ok = u < np.asarray(acc[:K])
    accepted = np.where(ok.all(axis=1), K, np.argmin(ok, axis=1))
    return costs.batch * (1 + accepted.mean()) / costs.cycle_s[str(K)]


def _random_costs(rng, batch: int) -> tuple[DepthCosts, list[float]]:
    plain = float(rng.uniform(0.001, 0.2))
    slope = float(rng.uniform(0.0, 1.5))  # verification + head cost per extra draft, in plain steps
    cycle = {"0": plain, **{str(k): plain * (1 + float(rng.uniform(0, 0.4)) + slope * k) for k in range(1, 6)}}
    acc = [float(a) for a in rng.uniform(0.2, 0.98, 5)]
    return DepthCosts(batch=batch, cycle_s=cycle, acceptance=acc), acc


def test_the_chosen_depth_is_as_fast_as_the_best_simulated_one(rng):
    naive_loses = 0
    for _ in range(40):
        costs, acc = _random_costs(rng, int(rng.integers(1, 9)))
        sim = {k: _simulated_tokens_per_s(costs, acc, k, rng) for k in range(6)}
        best = max(sim.values())
        assert sim[choose_depth(costs)] >= 0.95 * best, (costs, sim)
        # A broken picker (always the deepest, ignoring cost) is caught by the same check.
        naive_loses += sim[5] < 0.95 * best
    assert naive_loses > 0


def test_plain_decoding_is_chosen_where_mtp_would_lose():
    costs = DepthCosts(batch=8, cycle_s={"0": 1.0, "1": 2.2, "2": 3.0, "3": 3.9}, acceptance=[0.9, 0.9, 0.9])
    assert choose_depth(costs) == 0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)


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
    table[4] = DepthCosts(batch=4, cycle_s={"0": 1.0, "1": 5.0, "2": 6.0}, acceptance=[0.9, 0.9])
    eng = mtplx_ext.Engine(shipped, max_batch=4, depth="auto")
    assert not eng.mtp and eng.metrics()["depth"] == 0
    table[2] = DepthCosts(batch=2, cycle_s={"0": 1.0, "1": 1.0, "2": 1.05}, acceptance=[0.9, 0.9])
    eng = mtplx_ext.Engine(shipped, max_batch=2, depth="auto")
    assert eng.mtp and eng.depth == 2
    res = mtplx_ext.generate_greedy_batched(shipped, [[1, 2], [3]], max_new_tokens=8, depth="auto")
    assert res.depth == 2
    table[2] = DepthCosts(batch=2, cycle_s={"0": 1.0, "1": 3.0, "2": 4.0}, acceptance=[0.9, 0.9])
    res = mtplx_ext.generate_greedy_batched(shipped, [[1, 2], [3]], max_new_tokens=8, depth="auto")
    assert res.depth == 0 and res.drafted == 0
