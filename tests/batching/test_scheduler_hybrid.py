"""The continuous-batching Engine on hybrid trunks (qwen3_next, qwen3_5).

GatedDeltaNet layers keep a recurrent and a conv state per row; the engine
prefills a request alone, merges those rows into the running batch at the
request's own row, evicts finished rows, and commits per stream from the
states captured at every verified position. Each request must decode as it
would alone:

* greedy requests arriving at random cycles equal mlx-lm's `generate_step`
  of their prompt alone (near ties excepted), MTP at depths 1 and 2 (a keyed
  head, so every accepted length occurs) and plain decoding;
* seeded sampled requests give the tokens of decoding them alone, whatever
  else is in the batch;
* a cancelled row in the middle is evicted and its neighbours go on
  unchanged; rows and KV slots return to 0;
* the gated-delta routing is on while the engine thread runs and undone
  after `stop()`;
* recurrent layers the capture cannot route are refused.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from _engine import KeyedHead, drive, random_prompt, sampled_arrivals
from _greedy import _runtime, check_stream, reference

import mtplx_ext
from mtplx_ext.batching import Engine

FAMILIES = ["qwen3_next", "qwen3_5"]




@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("depth,mtp", [(1, True), (2, True), (1, False)])
def test_greedy_requests_arriving_at_random_cycles_equal_mlx_lm_decoding_of_each_prompt_alone(rng, family, depth, mtp):
    rt = _runtime(family, rng)
    arrivals, refs = [], []
    for i in range(7):
        # The first two arrive together with short prompts, long caps and no stop token, so at least two rows
        # run merged whatever the other draws are (random arrivals alone sometimes never overlapped).
        together = i < 2
        prompt = random_prompt(rng, rt, 1, 8 if together else 30)
        cap = 15 if together else int(rng.integers(1, 16))
        ref, gaps = reference(rt, prompt, cap)
        # Sometimes a token the stream will reach is a stop token.
        stops = {ref[int(rng.integers(len(ref)))]} if not together and rng.random() < 0.3 else set()
        refs.append((prompt, ref, gaps, stops, cap))
        arrival = 0 if together else int(rng.integers(0, 20))
        arrivals.append((arrival, dict(prompt=prompt, max_tokens=cap, stop_token_ids=sorted(stops))))
    model = KeyedHead(rt, [p + ref for p, ref, *_ in refs], rng) if mtp else rt
    eng = Engine(model, max_batch=3, depth=depth, use_mtp=mtp, prefill_chunk=8)
    live: list[int] = []
    reqs = drive(eng, arrivals, live=live)
    for i, (r, (_, ref, gaps, stops, cap)) in enumerate(zip(reqs, refs)):
        assert r.error is None and r.finish_reason in ("stop", "length"), r.error
        check_stream(i, r, ref, gaps, stops, cap)
    assert max(live) >= 2  # rows were merged into a running batch
    if mtp:
        s = eng.stats
        assert s.forwards == s.cycles  # per-stream commit: no repair forward
        assert 0 < s.accepted < s.drafted, (s.accepted, s.drafted)
        # Rows computed: every request's own cycles, at most a full batch per cycle.
        m = eng.metrics()
        assert sum(r.cycles for r in reqs) <= m["row_forwards"] <= m["cycles"] * eng.max_batch
    assert eng.live_streams == 0 and eng.kv_slots == 0


@pytest.mark.parametrize("family,mtp", [("qwen3_next", True), ("qwen3_5", True), ("qwen3_next", False)])
def test_seeded_sampled_requests_give_their_alone_tokens_whatever_else_is_in_the_batch(rng, family, mtp):
    rt = _runtime(family, rng)
    reqs_kw = sampled_arrivals(rng, rt, 6, hi=20)
    alone = [
        mtplx_ext.generate_batched(
            rt, [kw["prompt"]], max_new_tokens=kw["max_tokens"], sampler=kw["sampler"], row_seeds=[kw["seed"]],
            depth=2, use_mtp_draft=mtp,
        ).streams[0].tokens
        for kw in reqs_kw
    ]
    for trial in range(2):  # two arrival schedules, so different batch neighbours
        eng = Engine(rt, max_batch=3, depth=2, use_mtp=mtp, prefill_chunk=8)
        got = drive(eng, [(int(rng.integers(0, 20)), kw) for kw in reqs_kw])
        assert [r.tokens for r in got] == alone, f"schedule {trial}"
        assert eng.live_streams == 0 and eng.kv_slots == 0


def test_a_cancelled_middle_row_stops_and_leaves_with_the_next_halving_and_its_neighbours_go_on_unchanged(rng):
    rt = _runtime("qwen3_next", rng)
    prompts = [random_prompt(rng, rt, 1, 20) for _ in range(3)]
    caps = [14, 200, 18]
    eng = Engine(rt, max_batch=4, depth=2)
    with eng.session():
        reqs = [eng.submit(p, max_tokens=c) for p, c in zip(prompts, caps)]
        while len(reqs[1].tokens) < 4 and not reqs[1].done:
            eng.step()
        assert reqs[1].error is None and eng.live_streams == 3
        reqs[1].cancel()
        eng.step()
        assert reqs[1].finish_reason == "cancelled" and eng.live_streams == 2
        assert eng.batch_rows == 3, "one row of three finished: the batch keeps its shape"
        while not reqs[0].done:
            eng.step()
        eng.step()
        assert eng.batch_rows == (0 if reqs[2].done else 1), "two of three finished: the batch halves"
        while eng.step():
            pass
    for i in (0, 2):
        check_stream(i, reqs[i], *reference(rt, prompts[i], caps[i]), set(), caps[i])
    assert eng.live_streams == 0 and eng.kv_slots == 0


def test_the_gated_delta_routing_is_on_while_the_engine_runs_and_undone_after_stop(rng):
    import mlx_lm.models.qwen3_5 as q35
    import mlx_lm.models.qwen3_next as q3n
    from mlx_lm.models.gated_delta import gated_delta_update

    conv_call = nn.Conv1d.__call__
    rt = _runtime("qwen3_5", rng)
    prompts = [random_prompt(rng, rt, 1, 20) for _ in range(3)]
    routed: list[bool] = []

    def seen(ev):  # runs on the engine's thread
        routed.append(q35.gated_delta_update is not gated_delta_update and nn.Conv1d.__call__ is not conv_call)

    eng = Engine(rt, max_batch=4, depth=2)
    eng.start()
    try:
        reqs = [eng.submit(p, max_tokens=8, on_event=seen) for p in prompts]
        for r in reqs:
            list(r.events(timeout=60))
        long = eng.submit(prompts[0], max_tokens=2000)  # still open when the engine stops
        next(long.events(timeout=60))
    finally:
        eng.stop()
    assert routed and all(routed)
    assert q35.gated_delta_update is gated_delta_update and q3n.gated_delta_update is gated_delta_update
    assert nn.Conv1d.__call__ is conv_call
    assert long.finish_reason == "error" and "stopped" in long.error
    for i, (p, r) in enumerate(zip(prompts, reqs)):
        check_stream(i, r, *reference(rt, p, 8), set(), 8)
    assert mx.array([1.0, 2.0]).sum().item() == 3.0  # MLX still works on this thread


def test_recurrent_layers_the_capture_cannot_route_are_refused(rng):
    rt = _runtime("qwen3_next", rng)
    rt.trunk.model.layers[0].linear_attn = nn.Linear(4, 4)  # recurrent, but no GatedDeltaNet
    for mtp in (True, False):
        with pytest.raises(ValueError, match="not GatedDeltaNet layers"):
            Engine(rt, use_mtp=mtp, depth=1)
