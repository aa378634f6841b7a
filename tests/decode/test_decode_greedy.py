"""generate_greedy_batched: lossless against mlx-lm's own greedy decoding.

Every stream of a batched decode must equal plain greedy decoding of its
prompt alone with `mlx_lm.generate.generate_step` on the same trunk, token
for token. The one allowed difference is a genuine near tie: at the first
mismatch the reference's top-2 logit gap must be below TIE_TOL (batched and
single-stream forwards use different matmul shapes, so float32 rounding can
flip an exact-looking tie). Mismatches are never skipped.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext import generate_greedy_batched
from _greedy import (
    MODES,
    TIE_TOL,
    ScriptedHead,
    _prompts,
    _rng,
    _runtime,
    check_counters,
    check_stream,
    reference,
    rolls_back,
)

@pytest.mark.parametrize("model_type, reject_mode", MODES)
@pytest.mark.parametrize("B", [1, 3, 8])
def test_every_stream_equals_mlx_lm_greedy_decoding_of_its_prompt_alone(model_type, reject_mode, B):
    rng = _rng()
    rt = _runtime(model_type, rng)
    V = rt.vocab_size
    prompts = _prompts(rng, V, B, max_len=20)
    cap = int(rng.integers(8, 22)) | 1  # odd: the cap falls between a cycle's two tokens
    refs = [reference(rt, p, cap) for p in prompts]
    # A stop token from inside some reference, so streams do stop early.
    k = int(rng.integers(B))
    stops = {refs[k][0][int(rng.integers(1, cap))]} if B > 1 else set()
    head = ScriptedHead(rt, [r[0] for r in refs], prompts, "mixed", rng)
    runs = {
        "plain": (rt, dict(use_mtp_draft=False)),
        "mtp_own_head": (rt, dict(use_mtp_draft=True, reject_mode=reject_mode)),
        "mtp_mixed_head": (head, dict(use_mtp_draft=True, reject_mode=reject_mode)),
    }
    for name, (runtime, kw) in runs.items():
        r = generate_greedy_batched(runtime, prompts, max_new_tokens=cap, stop_token_ids=stops, **kw, depth=1)
        assert len(r.streams) == B
        for i, s in enumerate(r.streams):
            check_stream(i, s, *refs[i], stops, cap)
        check_counters(r, kw["use_mtp_draft"])


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
def test_prefill_in_chunks_changes_no_token(model_type, monkeypatch):
    import mtplx_ext.decode.cycle as decode

    rng = _rng()
    rt = _runtime(model_type, rng)
    prompts = _prompts(rng, rt.vocab_size, 3, max_len=20)
    cap = int(rng.integers(5, 10))
    refs = [reference(rt, p, cap) for p in prompts]
    monkeypatch.setattr(decode, "PREFILL_STEP", int(rng.integers(2, 7)))
    for mtp in (False, True):
        r = generate_greedy_batched(rt, prompts, max_new_tokens=cap, use_mtp_draft=mtp, depth=1)
        for i, s in enumerate(r.streams):
            check_stream(i, s, *refs[i], set(), cap)


class HeadRecorder:
    """Records the real head's draft (argmax of the last position) per stream and drafted index.

    A later call for the same index overwrites an earlier one, so graphs the
    pipelined loop built ahead and dropped leave only the one it used.
    """

    def __init__(self, rt, prompts: list[list[int]]):
        self.rt = rt
        self.lengths = [len(p) for p in prompts]
        self.drafts: dict[tuple[int, int], int] = {}
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def head_states(self, hidden, next_tokens, head_cache):
        chained, normed = self.rt.head_states(hidden, next_tokens, head_cache)
        logits = self.rt.head_logits(normed)
        T = next_tokens.shape[1]
        offset = np.array(head_cache[0].offset)  # advanced past this call's positions
        draft = np.array(mx.argmax(logits, axis=-1))
        for i, n in enumerate(self.lengths):
            for j in range(T):
                self.drafts[i, int(offset[i]) - T + j + 2 - n] = int(draft[i, j])
        self.calls += 1
        return chained, normed


@pytest.mark.parametrize("model_type, reject_mode", MODES)
@pytest.mark.parametrize("chunk, serial", [(None, True), (3, True), (None, False)])
def test_head_drafts_equal_the_head_run_on_the_committed_sequence(model_type, reject_mode, chunk, serial, monkeypatch):
    # The head's cache must hold exactly the (hidden at t, token t + 1) pairs
    # of the committed tokens, after accepted and after repaired cycles.
    import mtplx_ext.decode.cycle as decode

    if chunk:
        monkeypatch.setattr(decode, "PREFILL_STEP", chunk)
    rng = _rng()
    rt = _runtime(model_type, rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    cap = int(rng.integers(10, 16))
    refs = [reference(rt, p, cap)[0] for p in prompts]
    rec = HeadRecorder(rt, prompts)
    pattern = [1, 1, 0, 1, 0, 0, 1, 1]  # all-accept and repair cycles, both followed by both
    head = ScriptedHead(rec, refs, prompts, "pattern", rng, pattern=pattern)
    # Eager: the recorder reads each head call on the host, which a compiled
    # step (traced once) cannot do.
    r = generate_greedy_batched(
        head, prompts, max_new_tokens=cap, serial=serial, reject_mode=reject_mode, enforce_eager=True, depth=1
    )
    if rolls_back(model_type, reject_mode):
        assert r.repair_cycles == 0 and 0 < r.accepted < r.drafted
    else:
        assert 0 < r.repair_cycles < r.cycles - 2
    checked = 0
    for i, (p, s) in enumerate(zip(prompts, r.streams)):
        seq = p + s.tokens
        _, hidden = rt.forward(mx.array([seq]))
        logits = rt.head_forward(hidden[:, :-1], mx.array([seq[1:]]))[0]
        for g in range(1, len(s.tokens)):  # every committed index the head ran for
            t = len(p) + g - 2  # head position whose output drafts generated token g
            row = np.array(logits[t], dtype=np.float64)
            top = np.sort(row)[-2:]
            got = rec.drafts[i, g]
            if got != int(np.argmax(row)):
                assert top[1] - top[0] < TIE_TOL, f"stream {i}, token {g}: draft {got}, expected {np.argmax(row)}"
            checked += 1
    assert checked >= 3 * (cap // 2) - 3


@pytest.mark.parametrize(
    "model_type, layout",
    [("deepseek_v3", "deepseek"), ("mimo", "mimo"), ("qwen3", "mimo"), ("qwen3_5", "qwen3_next")],
)
def test_other_families_and_head_layouts_decode_losslessly(model_type, layout):
    rng = _rng()
    rt = _runtime(model_type, rng, head_layout=layout)
    prompts = _prompts(rng, rt.vocab_size, 3)
    cap = int(rng.integers(5, 10))
    refs = [reference(rt, p, cap) for p in prompts]
    head = ScriptedHead(rt, [r[0] for r in refs], prompts, "mixed", rng)
    for runtime in (rt, head):
        r = generate_greedy_batched(runtime, prompts, max_new_tokens=cap, depth=1)
        check_counters(r, True)
        for i, s in enumerate(r.streams):
            check_stream(i, s, *refs[i], set(), cap)


@pytest.mark.parametrize("model_type, reject_mode", MODES)
def test_oracle_head_never_repairs_and_wrong_head_repairs_or_rolls_back_every_cycle(model_type, reject_mode):
    rng = _rng()
    rt = _runtime(model_type, rng)
    prompts = _prompts(rng, rt.vocab_size, 4)
    cap = int(rng.integers(5, 12))
    refs = [reference(rt, p, cap) for p in prompts]
    ref_tokens = [r[0] for r in refs]
    cycles = math.ceil(cap / 2)

    kw = dict(max_new_tokens=cap, reject_mode=reject_mode)
    oracle = generate_greedy_batched(ScriptedHead(rt, ref_tokens, prompts, "oracle", rng), prompts, **kw, depth=1)
    wrong = generate_greedy_batched(ScriptedHead(rt, ref_tokens, prompts, "wrong", rng), prompts, **kw, depth=1)
    exact = True
    for r in (oracle, wrong):
        check_counters(r, True)
        for i, s in enumerate(r.streams):
            exact &= check_stream(i, s, *refs[i], set(), cap)
    if exact:  # scripted drafts follow the reference, so they are exact only without a near tie
        assert oracle.cycles == cycles
        assert oracle.repair_cycles == 0 and oracle.acceptance_rate == 1.0
        assert oracle.forwards == cycles and oracle.drafted == 4 * (cap // 2)
        assert wrong.accepted == 0
        if rolls_back(model_type, reject_mode):
            # One token per cycle, each a verification forward and nothing else.
            assert wrong.cycles == wrong.forwards == cap and wrong.repair_cycles == 0
            assert wrong.drafted == 4 * (cap - 1)
        else:
            assert wrong.cycles == cycles and wrong.repair_cycles == cycles - 1
            assert wrong.forwards == 2 * cycles - 1
            assert wrong.drafted == 4 * (cap // 2)


@pytest.mark.parametrize("model_type, reject_mode", MODES)
def test_pipelined_equals_serial_in_tokens_forwards_and_host_syncs(model_type, reject_mode):
    rng = _rng()
    rt = _runtime(model_type, rng)
    prompts = _prompts(rng, rt.vocab_size, 5)
    cap = int(rng.integers(8, 16))
    refs = [reference(rt, p, cap)[0] for p in prompts]
    stops = {refs[2][int(rng.integers(cap))]}
    mixed = ScriptedHead(rt, refs, prompts, "mixed", rng)
    for mtp in (False, True):
        results = []
        for serial in (True, False):
            runtime = mixed if mtp else rt
            committed: dict[int, list[int]] = {}
            r = generate_greedy_batched(
                runtime,
                prompts,
                max_new_tokens=cap,
                stop_token_ids=stops,
                use_mtp_draft=mtp,
                serial=serial,
                reject_mode=reject_mode,
                on_commit=lambda i, toks: committed.setdefault(i, []).extend(toks), depth=1,
            )
            check_counters(r, mtp)
            assert {i: s.tokens for i, s in enumerate(r.streams)} == committed
            results.append(r)
        s, p = results
        assert [x.tokens for x in s.streams] == [x.tokens for x in p.streams]
        assert [x.finish_reason for x in s.streams] == [x.finish_reason for x in p.streams]
        for f in ("cycles", "forwards", "repair_cycles", "drafted", "accepted", "host_syncs"):
            assert getattr(s, f) == getattr(p, f), f


def test_pipelined_guess_of_the_next_path_is_undone_when_wrong():
    # Runs of repairs then accepts make the pipelined loop guess "repair",
    # then meet an all-accept cycle (and the reverse): both guesses get
    # built, dropped and rebuilt.
    rng = _rng()
    rt = _runtime("qwen3_next", rng)
    prompts = _prompts(rng, rt.vocab_size, 2)
    pattern = [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0]
    cap = 2 * len(pattern) + 1
    refs = [reference(rt, p, cap) for p in prompts]
    head = ScriptedHead(rt, [r[0] for r in refs], prompts, "pattern", rng, pattern=pattern)
    # Uniform repair (per-stream commit never guesses a path).
    serial = generate_greedy_batched(head, prompts, max_new_tokens=cap, serial=True, reject_mode="reforward", depth=1)
    piped = generate_greedy_batched(head, prompts, max_new_tokens=cap, serial=False, reject_mode="reforward", depth=1)
    exact = True
    for r in (serial, piped):
        check_counters(r, True)
        for i, s in enumerate(r.streams):
            exact &= check_stream(i, s, *refs[i], set(), cap)
    assert [s.tokens for s in serial.streams] == [s.tokens for s in piped.streams]
    assert (serial.forwards, serial.repair_cycles) == (piped.forwards, piped.repair_cycles)
    if exact:
        assert piped.repair_cycles == pattern.count(0)


def test_finished_streams_take_no_part_in_the_accept_decision():
    rng = _rng()
    rt = _runtime("qwen3_next", rng)
    prompts = _prompts(rng, rt.vocab_size, 2)
    cap = int(rng.integers(6, 12))
    refs = [reference(rt, p, cap) for p in prompts]
    stop = refs[0][0][1]  # stream 0 ends at its second token, in cycle 1
    if stop in refs[1][0] or stop == refs[0][0][0]:
        pytest.skip("the stop token also occurs elsewhere")
    head = ScriptedHead(rt, [r[0] for r in refs], prompts, "oracle", rng)
    # Stream 0's drafts are all wrong: once it has finished, they must not
    # trigger repairs of stream 1, whose drafts are all right.
    head.table = mx.concatenate([(head.table[:1] + 1) % rt.vocab_size, head.table[1:]])
    r = generate_greedy_batched(head, prompts, max_new_tokens=cap, stop_token_ids={stop}, depth=1)
    for i, s in enumerate(r.streams):
        if not check_stream(i, s, *refs[i], {stop}, cap):
            return  # a near tie: counts no longer predictable
    assert r.streams[0].tokens == refs[0][0][:2]
    # Stream 0 rejects in cycle 1 but finishes there (its second token is
    # the stop), so no cycle repairs.
    assert r.accepted == r.drafted - 1
    assert r.repair_cycles == 0 and r.forwards == r.cycles


class StateRecorder:
    """Records the recurrent state (host copies) at every [B, 2] trunk forward."""

    def __init__(self, rt):
        self.rt = rt
        self.states: list[list[np.ndarray]] = []

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def forward(self, tokens, cache, **kw):
        if tokens.shape[1] == 2:
            from mtplx_ext.cache.rollback import recurrent_leaves

            self.states.append([np.array(a) for a in recurrent_leaves(cache)])
        return self.rt.forward(tokens, cache, **kw)


def test_repair_restores_hybrid_state_bit_exactly_to_that_of_a_run_that_never_drafted():
    rng = _rng()
    rt = _runtime("qwen3_next", rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    cap = int(rng.integers(6, 11))
    refs = [reference(rt, p, cap) for p in prompts]

    runs = {}
    exact = True
    for mode in ("oracle", "wrong"):
        rec = StateRecorder(ScriptedHead(rt, [r[0] for r in refs], prompts, mode, rng))
        # Eager: the recorder reads the state on the host at every forward.
        r = generate_greedy_batched(
            rec, prompts, max_new_tokens=cap, serial=True, enforce_eager=True, reject_mode="reforward", depth=1
        )
        runs[mode] = (r, rec.states)
        for i, s in enumerate(r.streams):
            exact &= check_stream(i, s, *refs[i], set(), cap)
    if not exact:
        pytest.skip("a genuine near tie made the scripted drafts leave the reference")
    (o, o_states), (w, w_states) = runs["oracle"], runs["wrong"]
    # Oracle: one verification per cycle. Wrong head: verification, then a
    # repair from the restored state, every cycle but the last.
    assert len(o_states) == o.cycles and len(w_states) == 2 * w.cycles - 1 and w.repair_cycles > 0
    for c in range(w.cycles):
        before_verify = w_states[2 * c]
        for a, b in zip(before_verify, o_states[c]):
            assert a.dtype == b.dtype and np.array_equal(a, b), f"cycle {c}: state drifted"
        if c < w.cycles - 1:
            for a, b in zip(w_states[2 * c + 1], before_verify):
                assert np.array_equal(a, b), f"cycle {c}: restore was not bit-exact"


class PoisonRow:
    """Makes the trunk's logits NaN for one stream once it is `after` tokens past its prompt.

    Decided on the device from the cache's per-stream offset, so it holds in
    compiled steps (traced once) and in graphs built ahead alike.
    """

    def __init__(self, rt, row: int, after: int, prompt_len: int):
        self.rt, self.row, self.start = rt, row, prompt_len + after

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def forward(self, tokens, cache, **kw):
        # Position of this forward's first token, per stream (a KV layer's): past the prompt only when decoding.
        offset = next(c for c in cache if hasattr(c, "offset")).offset
        logits, hidden = self.rt.forward(tokens, cache, **kw)
        bad = (mx.arange(logits.shape[0]) == self.row) & (offset >= self.start)
        logits = mx.where(bad[:, None, None], mx.array(float("nan"), logits.dtype), logits)
        return logits, hidden


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("serial", [False, True])
def test_nan_logits_of_a_live_stream_raise_an_error_naming_it(mtp, serial):
    rng = _rng()
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 4)
    row = int(rng.integers(4))
    runtime = PoisonRow(rt, row, int(rng.integers(0, 3)), len(prompts[row]))
    with pytest.raises(RuntimeError, match=rf"^stream {row}:"):
        generate_greedy_batched(runtime, prompts, max_new_tokens=12, use_mtp_draft=mtp, serial=serial, depth=1)


def test_nan_logits_of_a_finished_stream_are_ignored():
    rng = _rng()
    rt = _runtime("qwen3_next", rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    cap = 9
    refs = [reference(rt, p, cap) for p in prompts]
    stop = refs[0][0][1]  # stream 0 stops at its second token, in its first cycle; its row stays a while
    if stop == refs[0][0][0] or any(stop in r[0] for r in refs[1:]):
        pytest.skip("the stop token also occurs elsewhere")
    stops = {stop}
    runtime = PoisonRow(rt, 0, 1, len(prompts[0]))  # row 0's forwards after its first cycle
    r = generate_greedy_batched(runtime, prompts, max_new_tokens=cap, stop_token_ids=stops, depth=1)
    assert r.streams[0].tokens == refs[0][0][:2] and r.streams[0].finish_reason == "stop"
    for i in (1, 2):
        check_stream(i, r.streams[i], *refs[i], stops, cap)


@pytest.mark.parametrize("mtp", [False, True])
def test_one_new_token_is_the_prefill_token_with_no_decode_forward(mtp):
    rng = _rng()
    rt = _runtime("qwen3_next", rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    refs = [reference(rt, p, 1) for p in prompts]
    r = generate_greedy_batched(rt, prompts, max_new_tokens=1, use_mtp_draft=mtp, depth=1)
    assert (r.cycles, r.forwards, r.host_syncs, r.drafted) == (0, 0, 0, 0)
    for i, s in enumerate(r.streams):
        check_stream(i, s, *refs[i], set(), 1)


def test_bad_arguments_raise_errors_naming_them():
    rng = _rng()
    rt = _runtime("qwen3", rng)
    V = rt.vocab_size
    ok = [[1, 2, 3], [4]]
    cases = [
        (dict(prompts=[]), ValueError, "prompts"),
        (dict(prompts=[[1, 2], []]), ValueError, r"prompts\[1\]"),
        (dict(prompts=[[1, V]]), ValueError, r"prompts\[0\]\[1\]"),
        (dict(prompts=[[-1, 2]]), ValueError, r"prompts\[0\]\[0\]"),
        (dict(prompts=[[1.5]]), TypeError, r"prompts\[0\]\[0\]"),
        (dict(prompts="abc"), TypeError, "prompts"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
        (dict(reject_mode="rollback"), ValueError, "reject_mode"),
        (dict(stop_token_ids=[V + 3]), ValueError, "stop_token_ids"),
    ]
    for overrides, err, pattern in cases:
        kw = dict(prompts=ok, max_new_tokens=4)
        kw.update(overrides)
        with pytest.raises(err, match=pattern):
            generate_greedy_batched(rt, kw.pop("prompts"), **kw, depth=1)

    plain = _runtime("qwen3", rng, head_layout=None)
    with pytest.raises(ValueError, match="use_mtp_draft"):
        generate_greedy_batched(plain, ok, max_new_tokens=4, depth=1)
    r = generate_greedy_batched(plain, ok, max_new_tokens=3, use_mtp_draft=False)
    assert [len(s.tokens) for s in r.streams] == [3, 3]


def test_generate_batched_is_greedy_at_temperature_zero_and_refuses_sampling():
    from types import SimpleNamespace

    rng = _rng()
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    greedy = generate_greedy_batched(rt, prompts, max_new_tokens=7, depth=1)
    zero = mtplx_ext.generate_batched(rt, prompts, max_new_tokens=7, sampler=SimpleNamespace(temperature=0.0), depth=1)
    assert [s.tokens for s in zero.streams] == [s.tokens for s in greedy.streams]
    with pytest.raises(NotImplementedError):
        mtplx_ext.generate_batched(rt, prompts, max_new_tokens=7, sampler=SimpleNamespace(temperature=0.7), depth=1)
