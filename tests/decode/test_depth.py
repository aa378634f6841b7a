"""Depth-K MTP decoding: K chained drafts, one [B, K+1] verification, per-stream commit.

Lossless against mlx-lm's own greedy decoding at every depth and reject
mode (the near-tie rule of test_decode_greedy), with the head's own drafts
and with scripted heads whose acceptance pattern is known; a scripted head
right for exactly the first j drafts of every cycle must commit j + 1 tokens
per cycle, which also checks the per-depth statistics.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mtplx_ext import generate_greedy_batched
from _greedy import ScriptedHead, _prompts, _rng, _runtime, check_counters, check_stream, reference

FAMILIES = ["qwen3", "deepseek_v3", "glm4_moe", "mimo"]


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("B", [1, 3, 8])
def test_every_stream_equals_mlx_lm_greedy_decoding_at_depths_1_2_3_5(model_type, B):
    rng = _rng()
    rt = _runtime(model_type, rng)
    prompts = _prompts(rng, rt.vocab_size, B, max_len=14)
    cap = int(rng.integers(9, 20))
    refs = [reference(rt, p, cap) for p in prompts]
    k = int(rng.integers(B))
    stops = {refs[k][0][int(rng.integers(1, cap))]} if B > 1 else set()
    head = ScriptedHead(rt, [r[0] for r in refs], prompts, "mixed", rng)
    for depth in (1, 2, 3, 5):
        for reject_mode in ("repair", "reforward"):
            # The mixed head reaches every accepted length; the own head is random.
            for runtime in (head, rt) if depth == 3 else (head,):
                r = generate_greedy_batched(
                    runtime, prompts, max_new_tokens=cap, stop_token_ids=stops, depth=depth, reject_mode=reject_mode
                )
                for i, s in enumerate(r.streams):
                    check_stream(i, s, *refs[i], stops, cap)
                check_counters(r, True)
                assert r.depth == depth and len(r.reached) == depth
                if reject_mode == "repair":
                    assert r.repair_cycles == 0, "per-stream commit ran a repair forward"


@pytest.mark.parametrize("depth", [2, 4])
@pytest.mark.parametrize("reject_mode", ["repair", "reforward"])
def test_pipelined_equals_serial_and_compiled_equals_eager_at_depth(depth, reject_mode):
    rng = _rng()
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 4)
    cap = int(rng.integers(10, 18))
    refs = [reference(rt, p, cap)[0] for p in prompts]
    head = ScriptedHead(rt, refs, prompts, "mixed", rng)
    runs = {}
    for serial in (True, False):
        for eager in (True, False):
            r = generate_greedy_batched(
                head, prompts, max_new_tokens=cap, depth=depth, reject_mode=reject_mode, serial=serial,
                enforce_eager=eager,
            )
            runs[serial, eager] = ([s.tokens for s in r.streams], r.forwards, r.cycles, r.accepted_at, r.compiled)
    base = runs[True, True]
    for key, run in runs.items():
        assert run[:4] == base[:4], f"serial, eager = {key} differs from the serial eager decode"
        assert run[4] == (not key[1])


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
@pytest.mark.parametrize("reject_mode", ["repair", "reforward"])
def test_an_oracle_head_commits_k_plus_1_tokens_every_cycle(depth, reject_mode):
    rng = _rng()
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    cap = int(rng.integers(12, 25))
    refs = [reference(rt, p, cap) for p in prompts]
    head = ScriptedHead(rt, [r[0] for r in refs], prompts, "oracle", rng)
    r = generate_greedy_batched(head, prompts, max_new_tokens=cap, depth=depth, reject_mode=reject_mode)
    for i, s in enumerate(r.streams):
        assert check_stream(i, s, *refs[i], set(), cap)
    assert r.cycles == math.ceil(cap / (depth + 1))
    assert r.repair_cycles == 0 and r.accepted == r.drafted > 0
    assert r.acceptance_per_depth == [1.0] * depth


@pytest.mark.parametrize("depth", [1, 3, 5])
@pytest.mark.parametrize("reject_mode", ["repair", "reforward"])
def test_an_always_wrong_head_commits_one_token_per_cycle(depth, reject_mode):
    rng = _rng()
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    cap = int(rng.integers(8, 16))
    refs = [reference(rt, p, cap) for p in prompts]
    head = ScriptedHead(rt, [r[0] for r in refs], prompts, "wrong", rng)
    r = generate_greedy_batched(head, prompts, max_new_tokens=cap, depth=depth, reject_mode=reject_mode)
    for i, s in enumerate(r.streams):
        check_stream(i, s, *refs[i], set(), cap)
    assert r.accepted == 0 and r.reached[1:] == [0] * (depth - 1)
    if reject_mode == "repair":
        assert r.cycles == cap and r.forwards == r.cycles  # x0 only, no repair forward
    else:
        # Uniform repair commits x0 and the target's own token, and re-forwards.
        assert r.cycles == math.ceil(cap / 2) and r.repair_cycles >= r.cycles - 1


@pytest.mark.parametrize("depth, j", [(2, 1), (3, 1), (3, 2), (5, 3), (5, 4)])
def test_a_head_right_for_exactly_the_first_j_drafts_commits_j_plus_1_tokens(depth, j):
    rng = _rng()
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    cap = int(rng.integers(15, 30))
    refs = [reference(rt, p, cap) for p in prompts]
    head = ScriptedHead(rt, [r[0] for r in refs], prompts, "period", rng, period=j + 1)
    r = generate_greedy_batched(head, prompts, max_new_tokens=cap, depth=depth)
    for i, s in enumerate(r.streams):
        assert check_stream(i, s, *refs[i], set(), cap)
    assert r.cycles == math.ceil(cap / (j + 1)) and r.forwards == r.cycles
    # Drafts 1..j always accepted, draft j + 1 always rejected, later ones never checked.
    acc = r.acceptance_per_depth
    assert acc[:j] == [1.0] * j and acc[j] == 0.0 and r.reached[j + 1 :] == [0] * (depth - j - 1)
    # j accepted per cycle, except in a stream's last cycle, cut short by its cap.
    assert j * (r.stream_cycles - len(prompts)) <= r.accepted <= j * r.stream_cycles


def test_depth_out_of_range_or_not_an_int_is_refused_naming_depth():
    rt = _runtime("qwen3", _rng())
    for bad, err in [(0, ValueError), (9, ValueError), (2.0, TypeError), (True, TypeError), ("3", TypeError)]:
        with pytest.raises(err, match="depth"):
            generate_greedy_batched(rt, [[1, 2]], max_new_tokens=4, depth=bad)
    r = generate_greedy_batched(rt, [[1, 2]], max_new_tokens=4, depth=np.int64(2))
    assert r.depth == 2
