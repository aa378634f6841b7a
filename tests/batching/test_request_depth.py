"""Per-request MTP depth: rows of one batch that commit at most d drafts per cycle (0: one token per cycle)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _engine import drive as _drive
from _engine import random_prompt as _prompt
from _greedy import check_stream, reference
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine
from mtplx_ext.decode.bundle import COL_N, COL_TOKENS, drop_drafts_beyond
from mtplx_ext.shipped import SHIPPED_MODEL
import _seed


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED_MODEL)


def _cycle_commits(events: list) -> list[int]:
    """Tokens committed per decode cycle (the first event is the prefill's one token)."""
    return [len(e.tokens) for e in events if e.kind == "tokens"][1:]


def test_greedy_rows_of_mixed_depths_equal_mlx_lm_and_commit_at_most_their_depth(shipped):
    rng = _seed.rng()
    K = 3
    eng = Engine(shipped, max_batch=4, depth=K, prefill_chunk=16)
    arrivals, refs, events = [], [], []
    depths = [0, 1, 2, None, 0, 1]
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):"]
    for i, d in enumerate(depths):
        prompt = shipped.tokenizer.encode(prompts[i % 3]).ids if i < 3 else _prompt(rng, shipped, 1, 30)
        cap = int(rng.integers(16, 40))
        refs.append((reference(shipped, prompt, cap), cap))
        log: list = []
        events.append(log)
        arrivals.append((int(rng.integers(0, 8)), dict(prompt=prompt, max_tokens=cap, depth=d, on_event=log.append)))
    reqs = _drive(eng, arrivals)
    for i, (r, ((ref, gaps), cap), d, log) in enumerate(zip(reqs, refs, depths, events)):
        check_stream(i, r, ref, gaps, set(), cap)
        d = K if d is None else d
        per_cycle = _cycle_commits(log)
        assert max(per_cycle) <= d + 1, (i, d, per_cycle)
        assert r.depth == d and r.drafted <= d * r.cycles
        assert len(r.stats.reached) == d
        if d == 0:
            assert r.drafted == r.accepted == 0 and r.cycles == len(r.tokens)  # the first cycle repeats x0
    # The shipped head is right most of the time: the depths were used up to their caps (on the code prompts).
    for i in range(3):
        d = K if depths[i] is None else depths[i]
        assert d == 0 or max(_cycle_commits(events[i])) == d + 1, (i, _cycle_commits(events[i]))
    with pytest.raises(ValueError, match="depth"):
        eng.submit([1, 2, 3], depth=K + 1)
    with pytest.raises(TypeError, match="depth"):
        eng.submit([1, 2, 3], depth=1.0)
    plain = Engine(shipped, max_batch=1, depth=2, use_mtp=False)
    with pytest.raises(ValueError, match="depth"):
        plain.submit([1, 2, 3], depth=1)
    assert plain.submit([1, 2, 3], depth=0).depth == 0


def test_sampled_rows_of_mixed_depths_finish_and_honour_their_depth(shipped):
    rng = _seed.rng()
    eng = Engine(shipped, max_batch=3, depth=2)
    logs: list[list] = [[], [], []]
    cfgs = [SamplerConfig(temperature=0.8, top_p=0.95), SamplerConfig(temperature=0.9, frequency_penalty=0.3),
            SamplerConfig(temperature=0.7)]
    reqs = [eng.submit(shipped.tokenizer.encode("def main(argv):").ids, max_tokens=30, sampler=c, depth=d,
                       seed=int(rng.integers(0, 2**62)), on_event=log.append)
            for c, d, log in zip(cfgs, (0, 1, 2), logs)]
    eng.run_until_idle()
    for r, d, log in zip(reqs, (0, 1, 2), logs):
        assert r.error is None and len(r.tokens) == 30
        assert max(_cycle_commits(log)) <= d + 1
    # Each row's tokens are its own seed's: decoded alone at the same depth they are the same.
    alone = Engine(shipped, max_batch=1, depth=2)
    for r, c, d in zip(reqs, cfgs, (0, 1, 2)):
        a = alone.submit(r.prompt, max_tokens=30, sampler=c, depth=d, seed=r.seed)
        alone.run_until_idle()
        assert a.tokens == r.tokens


def test_a_dropped_draft_commits_a_draw_from_the_target_and_a_kept_one_would_not():
    # The verification a depth-d row gets: drafts past d are set to -1 and the
    # kernel rejects them, drawing c_{d+1} from p_{d+1} itself. A broken cut
    # that commits the draft there instead follows the head, and is rejected.
    rng = _seed.rng()
    B, K, V = 40_000, 2, 7
    vl = np.tile(rng.normal(size=(1, K + 1, V)) * 1.5, (B, 1, 1)).astype(np.float32)
    dl = np.tile(rng.normal(size=(1, K, V)) * 1.5, (B, 1, 1)).astype(np.float32)
    q = np.exp(dl[0].astype(np.float64))
    q /= q.sum(-1, keepdims=True)
    drafts = np.stack([rng.choice(V, size=B, p=q[j]) for j in range(K)], axis=1)
    tokens = np.concatenate([np.full((B, 1), 3), drafts], axis=1).astype(np.int32)
    row_depth = mx.array(np.ones(B, dtype=np.int32))
    cut = drop_drafts_beyond(mx.array(tokens), row_depth)
    u = mx.array(rng.random((B, K + 2)).astype(np.float32))
    b = np.array(mtplx_ext.verify_sampled_chain(mx.array(vl), mx.array(dl), cut, u, SamplerConfig()))
    assert b[:, COL_N].max() == 1 and b[:, COL_N].min() == 0
    p = np.exp(vl[0].astype(np.float64))
    p /= p.sum(-1, keepdims=True)
    first = b[:, COL_TOKENS]
    assert g_test_pvalue(np.bincount(first, minlength=V), p[0]) > ALPHA_EXACT
    went_on = b[:, COL_N] == 1
    second = b[went_on, COL_TOKENS + 1]
    assert g_test_pvalue(np.bincount(second, minlength=V), p[1]) > ALPHA_EXACT
    broken = drafts[went_on, 1]  # the head's draft committed at the cut
    assert g_test_pvalue(np.bincount(broken, minlength=V), p[1]) < ALPHA_BROKEN
