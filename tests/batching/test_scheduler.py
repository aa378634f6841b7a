"""The continuous-batching Engine: requests arriving at random cycles decode as if alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _engine import drive as _drive
from _engine import random_prompt as _prompt
from _engine import sampled_arrivals as _sampled_arrivals
from _greedy import check_stream, reference

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.decode import policies
from mtplx_ext.batching import Engine
from mtplx_ext.shipped import SHIPPED_MODEL
import _seed


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED_MODEL)


@pytest.fixture()
def rng():
    return _seed.rng()


@pytest.mark.parametrize("depth,mtp", [(2, True), (1, False)])
def test_greedy_requests_arriving_at_random_cycles_equal_mlx_lm_decoding_of_each_prompt_alone(shipped, rng, depth, mtp):
    eng = Engine(shipped, max_batch=4, depth=depth, use_mtp=mtp, prefill_chunk=16)
    arrivals, refs = [], []
    for i in range(9):
        prompt = _prompt(rng, shipped, 1, 50)
        cap = int(rng.integers(1, 24))
        ref, gaps = reference(shipped, prompt, cap)
        # Sometimes a token the stream will reach is a stop token.
        stops = {ref[int(rng.integers(len(ref)))]} if rng.random() < 0.4 else set()
        refs.append((ref, gaps, stops, cap))
        arrivals.append((int(rng.integers(0, 30)), dict(prompt=prompt, max_tokens=cap, stop_token_ids=sorted(stops))))
    reqs = _drive(eng, arrivals)
    for i, (r, (ref, gaps, stops, cap)) in enumerate(zip(reqs, refs)):
        assert r.error is None and r.finish_reason in ("stop", "length")
        check_stream(i, r, ref, gaps, stops, cap)
    if mtp:
        assert eng.metrics()["mean_accepted_length"] > 0.3  # the head's drafts were used
    assert eng.live_streams == 0 and eng.kv_slots == 0


def test_seeded_sampled_requests_give_their_alone_tokens_whatever_else_is_in_the_batch(shipped, rng):
    reqs_kw = _sampled_arrivals(rng, shipped, 6)
    alone = [
        mtplx_ext.generate_batched(
            shipped, [kw["prompt"]], max_new_tokens=kw["max_tokens"], sampler=kw["sampler"],
            row_seeds=[kw["seed"]], depth=2,
        ).streams[0].tokens
        for kw in reqs_kw
    ]
    for trial in range(2):  # two different arrival schedules, so different batch neighbours
        eng = Engine(shipped, max_batch=3, depth=2, prefill_chunk=8)
        got = _drive(eng, [(int(rng.integers(0, 25)), kw) for kw in reqs_kw])
        assert [r.tokens for r in got] == alone, f"schedule {trial}"


def test_a_late_sampled_request_without_its_own_step_count_draws_other_tokens(shipped, rng, monkeypatch):
    # The broken variant: every row counts the engine's cycles (no step_base).
    kw = _sampled_arrivals(rng, shipped, 1)[0]
    kw["sampler"], kw["max_tokens"] = SamplerConfig(temperature=1.5), 24
    alone = mtplx_ext.generate_batched(
        shipped, [kw["prompt"]], max_new_tokens=24, sampler=kw["sampler"], row_seeds=[kw["seed"]], depth=2
    ).streams[0].tokens
    early = dict(prompt=_prompt(rng, shipped), max_tokens=60)
    orig = policies.SampledPolicy.uniforms

    def no_base(self, step, calls, position=1):
        saved, self.step_base = self.step_base, None
        try:
            return orig(self, step, calls, position)
        finally:
            self.step_base = saved

    monkeypatch.setattr(policies.SampledPolicy, "uniforms", no_base)
    got = _drive(Engine(shipped, max_batch=2, depth=2), [(0, early), (15, kw)])[1].tokens
    assert got != alone


def test_kv_cap_makes_requests_wait_and_none_is_lost(shipped, rng):
    # Room for two rows of 128 slots: the others wait, in order, and all finish.
    eng = Engine(shipped, max_batch=8, depth=1, max_kv_slots=256)
    arrivals = [(0, dict(prompt=_prompt(rng, shipped, 1, 20), max_tokens=int(rng.integers(2, 30)))) for _ in range(6)]
    seen = []
    reqs = [None] * 6
    with eng.session():
        reqs = [eng.submit(**kw) for _, kw in arrivals]
        while eng.step():
            seen.append(eng.live_streams)
            assert eng.kv_slots <= 256
    assert max(seen) == 2
    assert all(r.finish_reason == "length" and len(r.tokens) == r.max_tokens for r in reqs)
    assert eng.live_streams == 0 and eng.kv_slots == 0


def test_requests_that_could_never_fit_are_refused_at_submit(shipped):
    eng = Engine(shipped, max_batch=2, max_kv_slots=256, context=300, depth=1)
    with pytest.raises(ValueError, match="max_kv_slots=256"):
        eng.submit([1] * 200, max_tokens=90)
    with pytest.raises(ValueError, match="exceeds the context of 300"):
        eng.submit([1] * 250, max_tokens=60)
    with pytest.raises(TypeError, match="^max_tokens"):
        eng.submit([1], max_tokens=2.5)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] = -3"):
        eng.submit([1, -3])
    with pytest.raises(ValueError, match="empty"):
        eng.submit([])
    assert eng.metrics()["submitted"] == 0


def test_a_cancelled_request_frees_its_row_at_the_next_step(shipped, rng):
    eng = Engine(shipped, max_batch=4, depth=2)
    with eng.session():
        a = eng.submit(_prompt(rng, shipped), max_tokens=200)
        b = eng.submit(_prompt(rng, shipped), max_tokens=30)
        while len(a.tokens) < 5 and not a.done:
            eng.step()
        assert eng.live_streams == 2, a.finish_reason
        a.cancel()
        eng.step()
        assert a.finish_reason == "cancelled" and eng.live_streams == 1
        while eng.step():
            pass
    assert b.finish_reason == "length" and len(b.tokens) == 30
    assert eng.live_streams == 0 and eng.kv_slots == 0


def test_a_long_prompt_is_prefilled_in_chunks_while_other_streams_decode(shipped, rng):
    eng = Engine(shipped, max_batch=4, depth=1, prefill_chunk=32)
    with eng.session():
        a = eng.submit(_prompt(rng, shipped, 5, 10), max_tokens=100)
        while not a.tokens:
            eng.step()
        long = eng.submit(_prompt(rng, shipped, 600, 600), max_tokens=4)
        during = 0
        eng.step()
        while not long.tokens and long.finish_reason is None:
            before = len(a.tokens)
            eng.step()
            during += len(a.tokens) > before
        while eng.step():
            pass
    # 600 tokens in chunks of 32: about 19 steps, each with a cycle of the other stream.
    assert during >= 15
    assert long.finish_reason == "length" and a.finish_reason == "length"


def test_a_failing_request_fails_alone(shipped, rng):
    eng = Engine(shipped, max_batch=4, depth=2)
    prompts = [_prompt(rng, shipped) for _ in range(3)]

    def boom(ev):
        if ev.kind == "tokens":
            raise RuntimeError("client callback broke")

    with eng.session():
        reqs = [eng.submit(p, max_tokens=12, on_event=boom if i == 1 else None) for i, p in enumerate(prompts)]
        while eng.step():
            pass
    assert reqs[1].finish_reason == "error" and "client callback broke" in reqs[1].error
    for i in (0, 2):
        ref, gaps = reference(shipped, prompts[i], 12)
        check_stream(i, reqs[i], ref, gaps, set(), 12)


def test_stop_strings_cut_the_text_and_end_the_request(shipped, rng):
    tok = shipped.tokenizer
    prompt = tok.encode("def main():\n    ").ids
    ref, _ = reference(shipped, prompt, 40)
    text = tok.decode(ref)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    eng = Engine(shipped, max_batch=2, depth=2)
    with eng.session():
        r = eng.submit(prompt, max_tokens=40, stop=[stop, "\x00never"])
        pieces = []
        r._on_event = lambda ev: pieces.append(ev.text)
        while eng.step():
            pass
    assert r.finish_reason == "stop"
    assert r.text == text[: text.find(stop)] == "".join(pieces)


def test_mlx_active_memory_stays_flat_over_many_requests(shipped, rng):
    eng = Engine(shipped, max_batch=4, depth=2)

    def wave():
        with eng.session():
            for _ in range(8):
                eng.submit(_prompt(rng, shipped, 1, 30), max_tokens=int(rng.integers(4, 16)))
            while eng.step():
                pass
        mx.clear_cache()
        return mx.get_active_memory()

    wave()
    first = wave()
    later = [wave() for _ in range(3)]
    assert max(later) - first < 2 * 2**20, (first, later)
    assert eng.metrics()["finished"] == 40


def test_the_engine_thread_serves_requests_from_other_threads(shipped, rng):
    eng = Engine(shipped, max_batch=4, depth=2)
    eng.start()
    try:
        prompts = [_prompt(rng, shipped) for _ in range(4)]
        reqs = [eng.submit(p, max_tokens=10) for p in prompts]
        events = [list(r.events(timeout=60)) for r in reqs]
    finally:
        eng.stop()
    for ev, r in zip(events, reqs):
        assert ev[-1].kind == "done"
        assert sum((e.tokens for e in ev), []) == r.tokens and len(r.tokens) == 10
    # MLX still works on this thread after the engine's thread dropped its streams.
    assert mx.array([1.0, 2.0]).sum().item() == 3.0


class _CountingTokenizer:
    """The shipped tokenizer, counting the token ids it decodes."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(list(ids))


def _stream_text(eng, tok, ids, chunks, stop):
    """Feeds `ids` to a request's detokenizer in commits of the given sizes."""
    from mtplx_ext.batching import Detokenizer

    r = Detokenizer(eng.tokenizer, tuple(stop))
    pieces, at = [], 0
    for n in chunks:
        out, cut = r.push(ids[at : at + n], final=at + n >= len(ids))
        at += n
        pieces.append(out)
        if cut:
            break
    return r, "".join(pieces), cut


def test_streamed_text_equals_the_whole_decode_cut_at_the_first_stop_string(shipped, rng):
    tok = _CountingTokenizer(shipped.tokenizer)
    eng = Engine(shipped, max_batch=1, depth=1, tokenizer=tok)
    V = shipped.vocab_size
    for trial in range(30):
        n = int(rng.integers(1, 120))
        ids = [int(x) for x in rng.integers(0, V, n)]
        chunks = [int(x) for x in rng.integers(1, 5, n)]
        full = shipped.tokenizer.decode(ids)
        stop = []
        if trial % 2 and len(full) > 4:  # a stop string taken from the text itself
            i = int(rng.integers(0, len(full) - 3))
            stop = [full[i : i + int(rng.integers(1, 4))]]
        r, text, cut = _stream_text(eng, tok, ids, chunks, stop)
        hits = [full.find(x) for x in stop if full.find(x) >= 0]
        want = full[: min(hits)] if hits else full
        # Cut at the first stop string: a stop string may end a commit whose text
        # goes beyond it; what was sent never includes it.
        assert text == want == r.text, (trial, ids, stop)
        assert cut == bool(hits)


def test_detokenizing_a_long_request_decodes_each_token_a_bounded_number_of_times(shipped, rng):
    tok = _CountingTokenizer(shipped.tokenizer)
    eng = Engine(shipped, max_batch=1, depth=1, tokenizer=tok)
    ids = [int(x) for x in rng.integers(0, shipped.vocab_size, 3000)]
    for stop in ([], ["\x00never"]):
        tok.decoded = 0
        _, text, _ = _stream_text(eng, tok, ids, [2] * 1500, stop)
        assert text == shipped.tokenizer.decode(ids)
        # Decoding the whole request at every commit would read 3000 * 1501 / 2 ids.
        assert tok.decoded <= 12 * len(ids), tok.decoded


def test_each_step_prefills_up_to_prefill_chunk_prompt_tokens_several_short_prompts_whole(shipped, rng):
    """While streams decode a step prefills at most `prefill_chunk` prompt tokens: short prompts together, long ones a chunk at a time."""
    chunk = 32
    eng = Engine(shipped, max_batch=8, depth=2, prefill_chunk=chunk)
    with eng.session():
        first = eng.submit(_prompt(rng, shipped, 5, 10), max_tokens=200)
        while eng.live_streams == 0:
            eng.step()
        lens = [int(n) for n in rng.integers(3, 9, size=4)]  # 12-32 tokens together
        short = [eng.submit(_prompt(rng, shipped, n, n), max_tokens=200) for n in lens]
        long_len = int(rng.integers(2 * chunk + 1, 3 * chunk))
        long = eng.submit(_prompt(rng, shipped, long_len, long_len), max_tokens=4)
        done = []
        for _ in range(4):
            before = eng.counters["prefill_tokens"]
            eng.step()
            done.append(eng.counters["prefill_tokens"] - before)
        assert done[0] == sum(lens)  # the four short prompts whole; the long one's first chunk does not fit
        assert all(r.tokens for r in short)  # each finished its prefill: its first token went out
        assert done[1:] == [chunk, chunk, long_len - 2 * chunk]  # then one chunk per step
        assert long.tokens and first.finish_reason is None
        for r in [first, *short]:
            r.cancel()
        eng.run_until_idle()
    assert eng.live_streams == 0 and eng.kv_slots == 0


def test_requests_over_quantized_kv_decode_what_each_decodes_alone_at_those_bits(shipped, rng):
    """Rows admitted, moved and merged between batches carry their quantized KV (`kv_bits=8`)."""
    eng = Engine(shipped, max_batch=3, depth=2, prefill_chunk=16, kv_bits=8)
    arrivals, want = [], []
    for _ in range(7):
        prompt = _prompt(rng, shipped, 1, 40)
        cap = int(rng.integers(1, 20))
        alone = mtplx_ext.generate_greedy_batched(shipped, [prompt], max_new_tokens=cap, use_mtp_draft=False, kv_bits=8)
        want.append(alone.streams[0].tokens)
        arrivals.append((int(rng.integers(0, 20)), dict(prompt=prompt, max_tokens=cap)))
    reqs = _drive(eng, arrivals)
    for i, (r, w) in enumerate(zip(reqs, want)):
        assert r.error is None and r.tokens == w, f"request {i}"
    assert eng.metrics()["recompositions"] > 0
