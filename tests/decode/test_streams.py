"""Streams: what each stream commits from a bundle, the prefill's x0 contract, statistics counted once."""

from __future__ import annotations

import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.decode.bundle import COL_N, COL_TOKENS, COL_X0
from mtplx_ext.decode.stats import DraftStats
from mtplx_ext.decode.streams import Streams


def _bundle(rows: list[tuple[int, int, list[int]]], K: int) -> np.ndarray:
    """[B, K + 3] chain bundles: (x0, n accepted, c_1..c_{n+1}; c_{n+1} is the next cycle's x0)."""
    b = np.full((len(rows), K + 3), -1, np.int32)
    for i, (x0, n, toks) in enumerate(rows):
        b[i, COL_X0], b[i, COL_N] = x0, n
        b[i, COL_TOKENS : COL_TOKENS + len(toks)] = toks
    return b


def _naive(K: int, n: int, committed: int) -> tuple[int, int]:
    """(drafts checked, drafts accepted) of a stream that commits `committed` tokens of a cycle with n accepted."""
    checked = min(K, n + 1, committed)  # draft j + 1 is checked when the stream went on after token j
    return checked, min(n, checked)


def test_record_counts_each_position_once_and_per_stream_stats_sum_to_the_batch(rng):
    K, B = 4, 3
    st = Streams(B, 100, 10_000, frozenset(), None, depth=K, per_stream=True)
    st.row_stats = [DraftStats(depth=K) for _ in range(B)]
    want = DraftStats(depth=K)
    for _ in range(50):
        rows = []
        for i in range(B):
            n = int(rng.integers(0, K + 1))
            rows.append((int(rng.integers(0, 100)), n, [int(t) for t in rng.integers(0, 100, n + 1)]))
        b = _bundle(rows, K)
        for i, (_, n, _) in enumerate(rows):
            _, new, reason = st.decide_stream(b, i)
            assert reason is None and len(new) == n + 1  # x0 and the accepted drafts
            want.record(*_naive(K, n, len(new)))
    s = st.result
    assert (s.drafted, s.accepted, s.reached, s.accepted_at, s.stream_cycles) == (
        want.drafted, want.accepted, want.reached, want.accepted_at, want.stream_cycles)
    assert sum(r.accepted for r in st.row_stats) == s.accepted
    assert sum(r.drafted for r in st.row_stats) == s.drafted
    assert [sum(c) for c in zip(*(r.reached for r in st.row_stats))] == s.reached


def test_a_stop_token_ends_the_walk_and_only_checked_drafts_count():
    K = 3
    st = Streams(1, 50, 100, frozenset({7}), None, depth=K, per_stream=True)
    _, new, reason = st.decide_stream(_bundle([(1, 3, [2, 7, 4, 5])], K), 0)
    assert new == [1, 2, 7] and reason == "stop"
    # x0 and d_1 went on (d_1, d_2 checked); the stop at d_2 ends the stream.
    assert st.result.reached == [1, 1, 0] and st.result.accepted_at == [1, 1, 0]


def test_an_x0_committed_at_the_prefill_is_left_out_once():
    K = 2
    st = Streams(2, 50, [6, 6], frozenset(), None, depth=K, per_stream=True)
    st.resume(committed=[1, 0], x0_committed=[True, False])
    b = _bundle([(9, 2, [3, 4, 5]), (8, 0, [6])], K)
    _, first, _ = st.decide_stream(b, 0)
    _, other, _ = st.decide_stream(b, 1)
    # A cycle commits x0, d_1..d_n; stream 0's x0 (9) went out at its prefill.
    assert first == [3, 4] and other == [8]
    assert list(st.count) == [3, 1]
    _, again, reason = st.decide_stream(b, 0)
    assert again == [9, 3, 4] and reason == "length"  # only once; its cap of 6 ends it
    assert st.done[0]


def test_the_engine_and_a_fixed_batch_count_acceptance_alike(shipped, rng):
    """One formula: a request's own statistics equal a fixed batch of that prompt alone."""
    prompt = [int(t) for t in rng.integers(0, shipped.vocab_size, 12)]
    alone = mtplx_ext.generate_greedy_batched(shipped, [prompt], max_new_tokens=40, depth=2)
    eng = mtplx_ext.Engine(shipped, max_batch=2, depth=2)
    r = eng.submit(prompt, max_tokens=40)
    eng.run_until_idle()
    assert r.tokens == alone.streams[0].tokens
    assert (r.stats.drafted, r.stats.accepted, r.stats.reached, r.stats.accepted_at) == (
        alone.drafted, alone.accepted, alone.reached, alone.accepted_at)
    m = eng.metrics()
    assert m["acceptance"] == pytest.approx(alone.acceptance_rate)
