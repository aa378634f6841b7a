"""Row compaction of a fixed batch (`engine.compaction`): fewer rows, the same tokens.

Streams are made to finish at very different cycles (a stop token taken
from inside one stream's reference, per-stream caps through the stop, a
scripted head that accepts for some streams and not others), so the batch
halves at least once. Every stream must still equal mlx-lm's greedy
decoding of its prompt alone (the near-tie rule of the lossless tests),
and the rows the batch forwarded must be fewer than cycles x B: a compactor
that gathered the wrong rows, or dropped a live one, fails the first check;
one that never compacted, the second.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplx_ext import SamplerConfig
from mtplx_ext.decode.generate import generate_reference as generate_batched  # (the reference loop's compaction)
from _greedy import ScriptedHead, _prompts, _rng, _runtime, check_counters, check_stream, reference


def _stops(rng: np.random.Generator, refs: list[list[int]]) -> set[int]:
    """The first tokens of half the references: those streams stop at once."""
    return {refs[k][0] for k in rng.permutation(len(refs))[: len(refs) // 2]}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("mode", ["plain", "own_head", "mixed_head"])
def test_compacted_batch_equals_mlx_lm_for_every_stream_and_forwards_fewer_rows(model_type, mode):
    rng = _rng()
    rt = _runtime(model_type, rng)
    B, cap = 8, 24
    prompts = _prompts(rng, rt.vocab_size, B, max_len=16)
    refs = [reference(rt, p, cap) for p in prompts]
    stops = _stops(rng, [r[0] for r in refs])
    runtime = ScriptedHead(rt, [r[0] for r in refs], prompts, "mixed", rng) if mode == "mixed_head" else rt
    kw = dict(max_new_tokens=cap, stop_token_ids=stops, use_mtp_draft=mode != "plain", depth=2)
    r = generate_batched(runtime, prompts, **kw)
    kept = generate_batched(runtime, prompts, compact_rows=False, **kw)
    for i, s in enumerate(r.streams):
        check_stream(i, s, *refs[i], stops, cap)
        assert s.tokens == kept.streams[i].tokens and s.finish_reason == kept.streams[i].finish_reason
    check_counters(r, mode != "plain")
    # A stream of n tokens is done once cycle n is read (every cycle commits
    # at least one token per live stream): with half of them done by cycle 3
    # and a cycle 4 to run, the batch halved before it.
    short = sum(len(s.tokens) <= 3 for s in r.streams)
    if short >= B // 2 and r.cycles >= 4:
        assert r.compactions >= 1
        assert r.row_cycles < r.cycles * B
    print(f"{short} streams of <= 3 tokens, {r.cycles} cycles, {r.compactions} compactions")
    assert kept.compactions == 0 and kept.row_cycles == kept.cycles * B
    assert r.cycles == kept.cycles


def test_sampled_batches_keep_their_rows():
    rng = _rng()
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 6)
    r = generate_batched(rt, prompts, max_new_tokens=12, sampler=SamplerConfig(temperature=0.8), seed=3,
                         stop_token_ids=set(range(0, rt.vocab_size, 5)), depth=2)
    assert r.compactions == 0 and r.row_cycles == r.cycles * len(prompts)
