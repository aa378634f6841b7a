"""`Engine.metrics()`'s draft counts per position, KV bytes and K per batch size, against independent counts.

The oracles: each request's own cycle count and accepted drafts (what the
responses' `mtp` field reports), the model config's KV shape, and the
depth map the engine was given.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.utils

from mtplx_ext.batching import Engine


def _prompt(rng, rt, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, rt.vocab_size, n)]


def test_drafts_proposed_per_position_follow_each_requests_cycles_and_depth_cap(shipped, rng):
    K = 3
    eng = Engine(shipped, max_batch=4, depth=K)
    caps = [None, 1, None, 2]  # per-request depth caps: a row proposes min(cap, K) drafts a cycle
    reqs = [eng.submit(_prompt(rng, shipped, int(rng.integers(4, 20))), max_tokens=int(rng.integers(8, 40)), depth=c)
            for c in caps]
    eng.run_until_idle()
    m = eng.metrics()
    depth = [K if c is None else c for c in caps]
    assert m["drafts_proposed"] == [sum(r.cycles for r, d in zip(reqs, depth) if d > i) for i in range(K)]
    assert sum(m["drafts_accepted"]) == sum(r.accepted for r in reqs) > 0
    assert m["stream_cycles"] == sum(r.stats.stream_cycles for r in reqs)
    for r, d in zip(reqs, depth):  # each request's own statistics follow the same rule
        assert r.stats.proposed_at == [r.cycles] * d  # its statistics span its own depth
        assert all(a <= c <= p for a, c, p in zip(r.stats.accepted_at, r.stats.reached, r.stats.proposed_at))


def test_kv_bytes_are_the_running_batchs_slots_times_the_configs_bytes_per_slot(shipped, rng):
    cfg = shipped.config
    itemsize = next(a.dtype.size for _, a in mlx.utils.tree_flatten(shipped.parameters())
                    if mx.issubdtype(a.dtype, mx.floating))
    layers = cfg["num_hidden_layers"] + len(shipped.mtp_modules)  # trunk and head attention layers
    per_slot = layers * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize  # keys and values
    eng = Engine(shipped, max_batch=4, depth=2)
    n = int(rng.integers(2, 5))
    for _ in range(n):
        eng.submit(_prompt(rng, shipped, int(rng.integers(4, 30))), max_tokens=64)
    seen = set()
    with eng.session():
        while eng.step():
            m = eng.metrics()
            assert m["kv_bytes"] == m["kv_slots"] * per_slot, m
            seen.add(m["live_streams"])
    assert n in seen  # checked with every request in the batch
    assert eng.metrics()["kv_bytes"] == 0 == eng.metrics()["kv_slots"]


def _running_depths(eng: Engine, reqs: list) -> dict[int, set[int]]:
    """{rows of the running batch: the batch_depth values seen with them}, stepping until idle."""
    ks: dict[int, set[int]] = {}
    with eng.session():
        while eng.step():
            m = eng.metrics()
            if m["live_streams"]:
                ks.setdefault(m["live_streams"], set()).add(m["batch_depth"])
    assert all(r.finish_reason == "length" for r in reqs)
    return ks


def test_depth_per_batch_size_is_the_map_given_and_the_running_batch_runs_its_k(shipped, rng):
    eng = Engine(shipped, max_batch=4, depth={1: 3, 4: 1})
    assert eng.metrics()["depth_per_batch_size"] == {"1": 3, "4": 1}
    alone = [eng.submit(_prompt(rng, shipped, 6), max_tokens=int(rng.integers(10, 30)))]
    assert _running_depths(eng, alone) == {1: {3}}
    three = [eng.submit(_prompt(rng, shipped, 6), max_tokens=int(rng.integers(20, 40))) for _ in range(3)]
    ks = _running_depths(eng, three)
    assert ks[3] == {1} and all(k == {1} for rows, k in ks.items() if rows > 1), ks  # the K of size 4
    assert eng.metrics()["depth_per_batch_size"] == {"1": 3, "4": 1}  # a given map does not move
    fixed = Engine(shipped, max_batch=4, depth=2)
    assert fixed.metrics()["depth_per_batch_size"] == {"4": 2}
