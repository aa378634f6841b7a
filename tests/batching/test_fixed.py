"""Fixed batches run on the engine (`batching.fixed`) and commit the reference loop's tokens.

`mtplx_ext.generate_batched` admits every prompt to an `Engine` at step 0;
the reference loop (`decode.generate_reference`) keeps a fixed batch and its
own compaction. Greedy streams must be equal token for token; seeded sampled
streams too (each row draws from its own seed's key whatever its batch).
"""

from __future__ import annotations

import itertools

import pytest
from _greedy import _prompts, _runtime

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine, fixed
from mtplx_ext.decode import generate_reference

CASES = [("qwen3", {}), ("qwen3_next", {}), ("deepseek_v3", {"head_layout": "deepseek"}),
         ("qwen3", {"num_nextn_predict_layers": 2, "mtp_num_hidden_layers": 2})]


def _engines(monkeypatch) -> list[int]:
    """Counts the engines the front builds."""
    built: list[int] = []
    real = Engine.__init__

    def spy(self, *a, **k):
        built.append(1)
        real(self, *a, **k)

    monkeypatch.setattr(Engine, "__init__", spy)
    return built


@pytest.mark.parametrize("family,kw", CASES, ids=[c[0] + ("-2mod" if c[1].get("mtp_num_hidden_layers") else "")
                                                  for c in CASES])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_engine_front_commits_the_reference_loops_tokens(rng, monkeypatch, family, kw, sampled):
    rt = _runtime(family, rng, **kw)
    prompts = _prompts(rng, rt.vocab_size, 4)
    cfg = SamplerConfig(temperature=1.3, top_p=0.95) if sampled else None
    seeds = [int(s) for s in rng.integers(0, 2**62, size=len(prompts))]
    depth = 3 if sampled else 2  # (the depth tests run every depth on the engine: tests/decode/test_depth.py)
    args = dict(max_new_tokens=int(rng.integers(6, 12)), sampler=cfg, row_seeds=seeds, depth=depth)
    built = _engines(monkeypatch)
    front = mtplx_ext.generate_batched(rt, prompts, **args)
    assert built, "the front did not run on the engine"
    ref = generate_reference(rt, prompts, **args)
    assert [s.tokens for s in front.streams] == [s.tokens for s in ref.streams], f"depth {depth}"
    assert [s.finish_reason for s in front.streams] == [s.finish_reason for s in ref.streams]
    assert front.depth == ref.depth == depth
    if not sampled:
        assert front.accepted == ref.accepted and front.drafted == ref.drafted


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("mtp", [False, True])
def test_streams_ending_at_their_first_token_end_there_while_the_others_go_on(rng, sampled, mtp):
    """A row's first token is read after its batch's first cycle launched (`PrefillPhase._defers`): a stream
    that this token ends sits in the launched batch finished; it must end with that one token, the others
    decode on as the reference loop's."""
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 5)
    cfg = SamplerConfig(temperature=1.3) if sampled else None
    seeds = [int(s) for s in rng.integers(0, 2**62, size=len(prompts))]
    first = generate_reference(rt, prompts, max_new_tokens=1, sampler=cfg, row_seeds=seeds, use_mtp_draft=mtp)
    x0 = [s.tokens[0] for s in first.streams]
    stops = {x0[0], x0[3]}
    args = dict(max_new_tokens=10, sampler=cfg, row_seeds=seeds, use_mtp_draft=mtp, depth=2, stop_token_ids=stops)
    front = mtplx_ext.generate_batched(rt, prompts, **args)
    ref = generate_reference(rt, prompts, **args)
    assert [s.tokens for s in front.streams] == [s.tokens for s in ref.streams]
    assert [s.finish_reason for s in front.streams] == [s.finish_reason for s in ref.streams]
    assert front.streams[0].tokens == [x0[0]] and front.streams[0].finish_reason == "stop"
    assert any(len(s.tokens) > 1 for s in front.streams), "every stream ended at its first token"


def test_a_seed_alone_derives_the_rows_seeds_as_the_reference_loop_does(rng):
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 4)
    args = dict(max_new_tokens=10, sampler=SamplerConfig(temperature=1.5), seed=int(rng.integers(1 << 40)), depth=2)
    front = mtplx_ext.generate_batched(rt, prompts, **args)
    assert [s.tokens for s in front.streams] == [s.tokens for s in generate_reference(rt, prompts, **args).streams]


@pytest.mark.parametrize("setting", [dict(reject_mode="reforward"), dict(enforce_eager=True)])
def test_uniform_repair_and_eager_graphs_run_the_reference_loop(rng, monkeypatch, setting):
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    built = _engines(monkeypatch)
    r = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=6, depth=2, **setting)
    assert not built and len(r.streams) == 3


def test_a_runtime_keeping_rows_outside_its_caches_runs_the_reference_loop(rng):
    rt = _runtime("qwen3", rng)

    class Rowed:
        def __getattr__(self, name):
            return getattr(rt, name)

        def keep_rows(self, rows):
            return self

    assert fixed.needs_reference(Rowed(), "repair", False) and not fixed.needs_reference(rt, "repair", False)


def test_compaction_off_keeps_every_row_and_changes_no_token(rng):
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 6)
    # Stop tokens that end four rows at their second token and two rows never: compaction has rows to drop,
    # and no row ends at its prefill (every row joins the batch).
    free = [s.tokens for s in mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=12, depth=2).streams]
    for long in itertools.combinations(range(6), 2):
        avoid = {t for i in long for t in free[i]} | {t[0] for t in free}
        stops = sorted({free[i][1] for i in range(6) if i not in long})
        if len(stops) >= 3 and not avoid & set(stops):
            break
    else:
        raise AssertionError(f"no two rows of {free} leave stop tokens for the others")
    runs = {c: mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=12, depth=2, compact_rows=c,
                                                 stop_token_ids=stops)
            for c in (True, False)}
    assert [s.tokens for s in runs[True].streams] == [s.tokens for s in runs[False].streams]
    assert runs[True].compactions > 0 and runs[False].compactions == 0
    assert runs[False].row_cycles == 6 * runs[False].cycles


@pytest.mark.parametrize("sampled", [False, True])
def test_a_second_fixed_batch_of_the_same_shapes_replays_the_first_ones_traced_steps(rng, monkeypatch, sampled):
    # A fixed batch hands its engine's traced steps back to the runtime (`Engine.release`): the next one of the
    # same shapes (every batch it compacts to included) runs no forward in Python but its prefill.
    rt = _runtime("qwen3", rng)
    prompts = _prompts(rng, rt.vocab_size, 4)
    args = dict(max_new_tokens=int(rng.integers(6, 12)), depth=2, row_seeds=[int(s) for s in rng.integers(0, 2**62, 4)],
                sampler=SamplerConfig(temperature=1.1) if sampled else None)
    first = mtplx_ext.generate_batched(rt, prompts, **args)
    calls: list[tuple[int, ...]] = []
    real = rt.forward

    def counting(tokens, *a, **k):
        calls.append(tuple(tokens.shape))
        return real(tokens, *a, **k)

    monkeypatch.setattr(rt, "forward", counting)
    second = mtplx_ext.generate_batched(rt, prompts, **args)
    assert [s.tokens for s in second.streams] == [s.tokens for s in first.streams]
    assert calls == [(len(prompts), max(len(p) for p in prompts))], f"forwards built in Python: {calls}"


def test_an_engine_releases_its_steps_only_when_idle(rng):
    rt = _runtime("qwen3", rng)
    eng = Engine(rt, max_batch=2, depth=2)
    eng.submit(_prompts(rng, rt.vocab_size, 1)[0], max_tokens=4)
    with pytest.raises(RuntimeError, match="idle"):
        eng.release()
    eng.run_until_idle()
    eng.release()
    eng.submit(_prompts(rng, rt.vocab_size, 1)[0], max_tokens=4)  # a released engine builds its batches again
    eng.run_until_idle()
