"""`Engine.step` says what it did (`StepResult`), checked against the requests' own observable outcome."""

from __future__ import annotations

from collections import Counter

from _engine import random_prompt

from mtplx_ext.batching import Engine, StepResult


def _run(eng: Engine, rng, shipped, n: int = 6):
    """Submits n requests at random steps (one cancelled after its first tokens); returns (requests, results,
    {request id: the step its last event came in})."""
    results: list[StepResult] = []
    ended: dict[int, list[int]] = {}
    arrivals = sorted((int(rng.integers(0, 12)), i) for i in range(n))
    reqs: dict[int, object] = {}
    cancel_at = None

    def on_event(ev, i):
        if ev.kind in ("done", "error"):
            ended.setdefault(reqs[i].id, []).append(len(results))

    with eng.session():
        for step in range(2000):
            while arrivals and arrivals[0][0] <= step:
                _, i = arrivals.pop(0)
                cap = 40 if i == 0 else int(rng.integers(1, 24))  # request 0 lives long enough to be cancelled
                reqs[i] = eng.submit(random_prompt(rng, shipped, 1, 30), max_tokens=cap,
                                     on_event=lambda ev, i=i: on_event(ev, i))
            if cancel_at is None and 0 in reqs and len(reqs[0].tokens) >= 2 and reqs[0].finish_reason is None:
                reqs[0].cancel()
                cancel_at = step
            res = eng.step()
            results.append(res)
            if not res and not arrivals:
                break
    return [reqs[i] for i in range(n)], results, ended


def test_step_results_add_up_to_each_requests_tokens_prefill_and_end(shipped, rng):
    eng = Engine(shipped, max_batch=3, depth=2, prefill_chunk=8)
    reqs, results, ended = _run(eng, rng, shipped)
    assert all(isinstance(r, StepResult) for r in results)
    assert all(bool(r) == (not r.idle) for r in results)
    assert results[-1].idle and not results[-1]
    committed: Counter[int] = Counter()
    for r in results:
        committed.update(r.committed)
    for q in reqs:
        assert committed[q.id] == len(q.tokens), q.id
    # Each request ends once, in the step whose run delivered its "done" / "error" event.
    finished = [rid for r in results for rid in r.finished]
    assert sorted(finished) == sorted(q.id for q in reqs)
    for q in reqs:
        assert [i for i, r in enumerate(results) if q.id in r.finished] == ended[q.id]
    # Admissions and prefills, each once; the prompt tokens forwarded are the engine's count.
    assert sorted(rid for r in results for rid in r.admitted) == sorted(q.id for q in reqs)
    prefilled = [rid for r in results for rid in r.prefilled]
    assert len(prefilled) == len(set(prefilled))
    forwarded: Counter[int] = Counter()
    for r in results:
        forwarded.update(r.prefill_tokens)
    assert sum(forwarded.values()) == eng.counters["prefill_tokens"]
    for q in reqs:
        assert forwarded[q.id] <= len(q.prompt)
        if q.tokens:  # its first token went out at the end of its prefill, in that step
            step = next(i for i, r in enumerate(results) if q.id in r.prefilled)
            assert forwarded[q.id] == len(q.prompt) and results[step].committed.get(q.id, 0) >= 1
            assert all(q.id not in r.committed for r in results[:step])
    # Recompositions and cycles: the engine's counters, and the rows each cycle ran.
    assert sum(r.recomposed is not None for r in results) == eng.counters["recompositions"]
    drained = sum(r.recomposed is not None and r.recomposed.drained for r in results)
    cycles = sum(r.cycle is not None for r in results)
    assert 0 < cycles <= eng.stats.cycles <= cycles + drained  # (a drained cycle is read before the rebuild)
    rows = 0
    for r in results:
        if r.recomposed is not None:
            rc = r.recomposed
            assert not set(rc.left) & set(rc.kept) and set(rc.joined) <= set(prefilled)
            rows = rc.rows
            assert (rc.depth is None) == (rows == 0)
        if r.cycle is not None:
            assert r.cycle.rows == rows and r.cycle.depth == eng.cycle_depth == 2
    assert reqs[0].finish_reason == "cancelled"


def test_a_step_with_nothing_to_do_is_idle_and_falsy(shipped, rng):
    eng = Engine(shipped, max_batch=2, depth=2)
    with eng.session():
        res = eng.step()
    assert res == StepResult() and res.idle and not res and res.tokens == 0
    req = eng.submit(random_prompt(rng, shipped, 2, 6), max_tokens=3)
    with eng.session():
        first = eng.step()
        assert first.admitted == (req.id,) and first and not first.idle
        while eng.step():
            pass
        assert not eng.step()
    assert req.finish_reason == "length" and len(req.tokens) == 3
