"""The scheduler's rules on their own (`batching.scheduler`: plain Python, no model, no MLX)."""

from __future__ import annotations

import pytest

from mtplx_ext.batching.admission import capacity
from mtplx_ext.batching.scheduler import (BatchShape, PrefillChunk, RowInfo, Waiting, kind_of, plan_batch,
                                          plan_prefill)


def waiting(i: int, prompt: int, need: int = 100, remaining: int | None = None) -> Waiting:
    return Waiting(RowInfo(i, need), prompt, remaining)


def test_an_idle_engine_prefills_every_request_that_fits_whole_and_in_order():
    plan = plan_prefill([waiting(0, 40), waiting(1, 600), waiting(2, 10)], [], False, 256, 8, 10_000)
    assert plan.chunks == (PrefillChunk(0, True, 1, 0), PrefillChunk(1, True, 3), PrefillChunk(2, True, 1, 2))


def test_nothing_overtakes_a_request_that_does_not_fit_yet():
    held = [RowInfo(9, 100)]
    plan = plan_prefill([waiting(0, 8), waiting(1, 8, need=5000), waiting(2, 8)], held, False, 256, 8,
                        3 * capacity(100))
    assert [c.id for c in plan.chunks] == [0]
    plan = plan_prefill([waiting(0, 8)], [RowInfo(i, 1) for i in range(2)], False, 256, 2, 10_000)
    assert plan.chunks == (), "a third row does not fit max_batch = 2"


def test_whole_prompts_starting_together_prefill_as_one_group_per_policy_class():
    def info(i: int, kind: str = "greedy", constrained: bool = False) -> Waiting:
        return Waiting(RowInfo(i, 100, kind=kind, constrained=constrained), 8)

    queue = [info(0), info(1, constrained=True), info(2, "sampled"), info(3, "penalties"),
             Waiting(RowInfo(4, 100), 300), info(5), info(6)]
    plan = plan_prefill(queue, [], False, 256, 8, 10_000)
    groups = [c.group for c in plan.chunks]
    assert groups[0] == groups[1] is not None, "greedy rows arriving together share one forward, constrained too"
    assert groups[2] == groups[3] not in (None, groups[0]), "sampled rows (penalties too) form their own group"
    assert groups[4] is None, "a prompt longer than a chunk goes alone"
    assert groups[5] == groups[6] not in (None, groups[0]), "a group never spans a row that goes alone"


def test_a_group_holds_at_most_a_chunk_of_padded_tokens():
    plan = plan_prefill([waiting(i, n) for i, n in enumerate([10, 30, 20, 20, 5])], [], False, 64, 8, 10_000)
    groups = [c.group for c in plan.chunks]
    # 10 + 30 padded: 2 x 30 = 60 fits 64; a third row would make 3 x 30 = 90.
    assert groups[0] == groups[1] != groups[2] == groups[3] == groups[4], groups


def test_while_streams_decode_a_step_forwards_one_chunk_of_prompt_tokens():
    # Short prompts go whole within the budget; a first chunk larger than what is left waits a step.
    plan = plan_prefill([waiting(0, 5), waiting(1, 5), waiting(2, 30)], [RowInfo(9, 50)], True, 16, 8, 10_000)
    assert plan.chunks == (PrefillChunk(0, True, 1, 0), PrefillChunk(1, True, 1, 0)), "arriving together: one forward"
    # A long prompt takes one chunk a step and goes on where it stopped.
    first = plan_prefill([waiting(0, 40), waiting(1, 4)], [RowInfo(9, 50)], True, 16, 8, 10_000)
    assert first.chunks == (PrefillChunk(0, True, 1),)
    later = plan_prefill([waiting(0, 40, remaining=8), waiting(1, 4)], [RowInfo(9, 50)], True, 16, 8, 10_000)
    assert later.chunks == (PrefillChunk(0, False, 1), PrefillChunk(1, True, 1, 1))


def test_a_batch_is_rebuilt_only_when_something_changed():
    live = [RowInfo(0, 10), RowInfo(1, 10)]
    assert plan_batch(live, [], False, True, lambda b: 3) is None
    assert plan_batch(live, [RowInfo(5, 10, finished=True)], False, True, lambda b: 3) is None
    assert plan_batch(live, [], True, True, lambda b: 3).keep == (0, 1)  # K should move


def test_the_rebuilt_batch_keeps_row_order_and_takes_its_shape_from_its_rows():
    live = [RowInfo(0, 10, "sampled", depth=3), RowInfo(1, 10, finished=True),
            RowInfo(2, 300, "greedy", logprobs=True, depth=1)]
    ready = [RowInfo(3, 20, "penalties", biased=True, constrained=True, depth=3), RowInfo(4, 5, finished=True)]
    sizes = []
    plan = plan_batch(live, ready, False, True, lambda b: sizes.append(b) or 2)
    assert (plan.keep, plan.join, sizes) == ((0, 2), (0,), [3])
    assert plan.shape == BatchShape(rows=3, capacity=capacity(300), kind="penalties", masked=True, biased=True,
                                    logprobs=True, capped=True, depth=2)
    plain = plan_batch(live, ready, False, False, lambda b: pytest.fail("no K without MTP"))
    assert plain.shape.depth == 0 and not plain.shape.capped
    gone = plan_batch([RowInfo(0, 10, finished=True)], [], False, True, lambda b: 1)
    assert gone.shape is None and gone.keep == ()


def test_the_policy_kind_is_the_most_demanding_rows():
    assert kind_of([]) == "greedy"
    assert kind_of([RowInfo(0, 1, "greedy"), RowInfo(1, 1, "sampled")]) == "sampled"
    assert kind_of([RowInfo(0, 1, "penalties"), RowInfo(1, 1, "sampled")]) == "penalties"
