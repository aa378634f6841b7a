"""Rows moving between batches of different K, 0 (no drafts) included, stay exact.

`Engine(depth={batch size: K})` (and depth="auto", which picks K per size
from the calibration, 0 where drafting does not pay) runs a batch at the K of
its size, so a row moves whenever the batch grows or shrinks past a size: from
an MTP batch into a K = 0 batch (its drafts are dropped, its uncommitted x0
goes on) and back (padded drafts for one cycle, then the head drafts again).
Greedy rows must commit plain decoding's tokens through any number of moves;
sampled rows must keep the model's distribution at the move, and a broken
move (a dropped row's first draft kept as if verified) must be rejected.
"""

from __future__ import annotations

import numpy as np
import pytest

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine, batch as batch_mod
from mtplx_ext.shipped import SHIPPED_MODEL
from _engine import drive, random_prompt
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue
from _joint import expected_joint


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED_MODEL)


def test_greedy_rows_moving_between_plain_and_mtp_batches_commit_plain_decodings_tokens(rng, shipped):
    # Sizes 1 and 3 draft (K = 3, 1), sizes 2 and 4 do not: arrivals and exits move rows both ways.
    eng = Engine(shipped, max_batch=4, depth={1: 3, 2: 0, 3: 1, 4: 0})
    # Four long requests arriving a few steps apart pass through sizes 1, 2, 3 and 4 (K = 3, 0, 1, 0); five more
    # at random steps and lengths move rows on as they come and go.
    arrivals = [(4 * i, dict(prompt=random_prompt(rng, shipped, 1, 12), max_tokens=int(rng.integers(40, 48))))
                for i in range(4)]
    arrivals += sorted(((int(s), dict(prompt=random_prompt(rng, shipped, 1, 12), max_tokens=int(rng.integers(8, 48))))
                        for s in rng.integers(16, 60, size=5)), key=lambda a: a[0])
    seen_k = set()
    reqs = []
    pending = list(arrivals)
    with eng.session():
        for step in range(5000):
            while pending and pending[0][0] <= step:
                reqs.append(eng.submit(**pending.pop(0)[1]))
            busy = eng.step()
            if eng.live_streams:
                seen_k.add(eng.cycle_depth)
            if not busy and not pending:
                break
    assert {0, 1, 3} <= seen_k, f"the run never moved rows across K = 0 and K > 0 batches: {seen_k}"
    plain = mtplx_ext.generate_greedy_batched(shipped, [a[1]["prompt"] for a in arrivals], max_new_tokens=48,
                                               use_mtp_draft=False)
    for i, (r, s) in enumerate(zip(reqs, plain.streams)):
        assert r.finish_reason in ("stop", "length"), (i, r.error)
        n = len(r.tokens)
        assert r.tokens == s.tokens[:n], f"request {i} differs from plain decoding"
    assert sum(r.stats.accepted for r in reqs) > 0, "no draft was accepted: the MTP batches were not exercised"


def _first_two_through_a_move(rt, prompt, cfg, seeds, monkeypatch) -> np.ndarray:
    """Each request is prefilled alone, drafting the K = 2 of the batch it expects (sizes up to n - 1), then all
    decode in the full batch at K = 0: their drafts are dropped at their first cycle, which commits the token
    after the prefill's."""
    n = len(seeds)
    # A chunk of one prompt: each prefills alone (requests arriving together would otherwise prefill as one
    # group, drafting the K of the full batch: none).
    eng = Engine(rt, max_batch=n, depth={n - 1: 2, n: 0}, prefill_chunk=len(prompt))
    dropped = []
    fit = batch_mod.fit_drafts  # (the broken variant's, when the test put one in)

    def counting(nxt, info, depth, vocab):
        if depth == 0:
            dropped.append(nxt.shape[1] - 1)
        return fit(nxt, info, depth, vocab)

    monkeypatch.setattr(batch_mod, "fit_drafts", counting)
    reqs = drive(eng, [(0, dict(prompt=prompt, max_tokens=2, sampler=cfg, seed=s)) for s in seeds])
    assert eng.cycle_depth == 0 and sum(d == 2 for d in dropped) == n - 1, f"no drafts to drop: {dropped}"
    return np.array([r.tokens for r in reqs])


SAMPLED = SamplerConfig(temperature=1.5, top_p=0.95, presence_penalty=0.4)


def test_sampled_rows_keep_the_models_distribution_when_their_drafts_are_dropped(rng, monkeypatch):
    V = 8
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=V)
    prompt = rng.integers(0, V, size=4).tolist()
    pairs = _first_two_through_a_move(rt, prompt, SAMPLED, rng.integers(0, 2**62, size=1024).tolist(), monkeypatch)
    joint = expected_joint(rt, prompt, SAMPLED)
    p = g_test_pvalue(np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V), joint.reshape(-1))
    assert p >= ALPHA_EXACT, f"a move into a K = 0 batch changed the distribution: p = {p:.2e}"


def test_the_same_test_rejects_a_move_that_keeps_a_draft_as_verified(rng, monkeypatch):
    V = 8
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=V)
    prompt = rng.integers(0, V, size=4).tolist()
    real = batch_mod.fit_drafts

    def keeps_the_first_draft(nxt, info, depth, vocab):
        if depth == 0 and nxt.shape[1] > 1:  # the row goes on from d_1, never verified, instead of x0
            return nxt[:, 1:2], None
        return real(nxt, info, depth, vocab)

    monkeypatch.setattr(batch_mod, "fit_drafts", keeps_the_first_draft)
    pairs = _first_two_through_a_move(rt, prompt, SAMPLED, rng.integers(0, 2**62, size=1024).tolist(), monkeypatch)
    joint = expected_joint(rt, prompt, SAMPLED)
    p = g_test_pvalue(np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V), joint.reshape(-1))
    assert p < ALPHA_BROKEN, f"a broken move was not detected: p = {p:.2e}"


@pytest.mark.parametrize("depth, match", [({}, "at least one"), ({0: 1}, "batch size"), ({2: 9}, r"depth\[2\]"),
                                          ({2: -1}, r"depth\[2\]"), ({"a": 1}, "batch size")])
def test_a_bad_depth_map_is_refused_naming_it(shipped, depth, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Engine(shipped, max_batch=4, depth=depth)
