"""CompiledStep and fixed-capacity ragged caches: replayed steps equal eager ones."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache

import mtplx_ext
# The compiled steps as the reference loop builds, grows and keeps them (the engine's batches: tests/batching).
from mtplx_ext.decode import generate_greedy_reference as generate_greedy_batched
from mtplx_ext.decode import generate_reference as generate_batched
from mtplx_ext.cache import rollback as cache_state
from mtplx_ext.cache.compiled_step import CompiledStep
from _ragged import fresh_seed, ragged_batch
import _seed


def test_compiled_pair_steps_with_rollbacks_equal_the_same_steps_run_eagerly():
    # The step a decode cycle repeats: a [B, 2] forward, then a per-stream
    # rollback by counts that come from the device. Replayed by mx.compile
    # over fixed-capacity caches it must track eager growable caches.
    rng = _seed.rng()
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    V, B, steps = rt.vocab_size, 3, int(rng.integers(4, 9))
    toks, pads = ragged_batch(rng, V, B)
    eager = rt.make_cache(pads, ragged=True)
    fixed = rt.make_cache(pads, ragged=True, capacity=toks.shape[1] + 2 * steps + int(rng.integers(0, 5)))
    for c in (eager, fixed):
        rt.forward(toks, c)
        mx.eval([l.state for l in c])
    traces = []

    def step(pair: mx.array, drop: mx.array) -> mx.array:
        traces.append(1)
        logits, _ = rt.forward(pair, fixed)
        cache_state.rollback_streams(fixed, drop)
        return logits

    compiled = CompiledStep(step, [fixed])
    for _ in range(steps):
        pair = mx.array(rng.integers(0, V, size=(B, 2)).astype(np.int32))
        drop = mx.array(rng.integers(0, 3, size=B).astype(np.int32))
        got = compiled(pair, drop)
        want, _ = rt.forward(pair, eager)
        cache_state.rollback_streams(eager, drop)
        np.testing.assert_allclose(np.array(got, np.float64), np.array(want, np.float64), rtol=1e-4, atol=1e-4)
    assert len(traces) == 1, f"traced {len(traces)} times: the step was not replayed"
    assert np.array_equal(np.array(fixed[0].ends), np.array(eager[0].ends))


def test_compiled_step_refuses_caches_without_a_fixed_capacity():
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    growable = rt.make_cache([0, 1], ragged=True)
    with pytest.raises(ValueError, match=r"cache_lists\[0\]\[0\].*neither a fixed-capacity"):
        CompiledStep(lambda t: t, [growable])
    with pytest.raises(ValueError, match=r"cache_lists\[1\]\[0\].*BatchKVCache"):
        CompiledStep(lambda t: t, [[], [BatchKVCache([0])]])
    empty = rt.make_cache([0, 1], ragged=True, capacity=8)
    with pytest.raises(ValueError, match="not allocated"):
        CompiledStep(lambda t: t, [empty])


def test_a_fixed_capacity_cache_refuses_a_forward_past_its_capacity():
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    cache = rt.make_cache([0, 0], ragged=True, capacity=5)
    rt.forward(mx.zeros((2, 4), mx.int32), cache)
    with pytest.raises(ValueError, match=r"capacity exceeded: 4 \+ 2 slots > capacity 5"):
        rt.forward(mx.zeros((2, 2), mx.int32), cache)
    with pytest.raises(ValueError, match="capacity must be"):
        rt.make_cache([0], ragged=True, capacity=0)
    with pytest.raises(ValueError, match="only supported with ragged"):
        rt.make_cache([0], capacity=8)


class CountingForwards:
    """Counts the runtime's trunk forwards that Python actually builds."""

    def __init__(self, rt):
        self.rt, self.calls = rt, 0

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def forward(self, *args, **kw):
        self.calls += 1
        return self.rt.forward(*args, **kw)


MODES = [
    ("qwen3", dict(use_mtp_draft=False)),
    ("qwen3", dict()),  # per-stream rollback: one compiled step per cycle
    ("qwen3", dict(reject_mode="reforward")),  # uniform repair: first, accept and repair steps
    ("qwen3_next", dict()),  # recurrent layers: uniform repair
    ("qwen3_next", dict(use_mtp_draft=False)),
]


@pytest.mark.parametrize("model_type, kw", MODES)
@pytest.mark.parametrize("serial", [False, True])
def test_greedy_decoding_builds_its_steps_in_python_once_and_replays_them(model_type, kw, serial):
    rng = _seed.rng()
    rt = mtplx_ext.init_random(model_type, seed=fresh_seed())
    prompts = [rng.integers(0, rt.vocab_size, size=int(n)).tolist() for n in rng.integers(2, 9, size=3)]
    runs = {}
    for eager in (False, True):
        counting = CountingForwards(rt)
        r = generate_greedy_batched(counting, prompts, max_new_tokens=24, serial=serial, enforce_eager=eager, **kw, depth=1)
        runs[eager] = (r, counting.calls)
    (compiled, built), (eager, eager_built) = runs[False], runs[True]
    assert compiled.compiled and not eager.compiled
    # Prefill, then one trace per kind of step (a repair step forwards twice).
    most = 2 if not kw.get("use_mtp_draft", True) or (model_type, kw) == MODES[1] else 5
    assert built <= most, f"{built} forwards built in Python: the steps were not replayed"
    assert eager_built > 10
    assert (compiled.forwards, compiled.cycles, compiled.repair_cycles) == (
        eager.forwards, eager.cycles, eager.repair_cycles,
    )
    for i, (a, b) in enumerate(zip(compiled.streams, eager.streams)):
        assert a.tokens == b.tokens, f"stream {i}"


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("penalties", [False, True])
def test_compiled_sampled_decoding_draws_the_eager_tokens(mtp, penalties):
    # The cycle number is an input of the compiled step and the uniforms'
    # keys are derived from it on the device: a step that baked the cycle
    # number in (or dropped the penalty counts) would draw other tokens.
    from mtplx_ext import SamplerConfig

    rng = _seed.rng()
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed(), vocab_size=32)
    prompts = [rng.integers(0, rt.vocab_size, size=int(n)).tolist() for n in rng.integers(2, 9, size=3)]
    extra = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2) if penalties else {}
    cfg = SamplerConfig(temperature=1.0, top_k=20, **extra)
    seed = int(rng.integers(1 << 30))
    runs = {}
    for eager in (False, True):
        counting = CountingForwards(rt)
        r = generate_batched(
            counting, prompts, max_new_tokens=20, sampler=cfg, seed=seed, use_mtp_draft=mtp, enforce_eager=eager, depth=1
        )
        runs[eager] = (r, counting.calls)
    (compiled, built), (eager, _) = runs[False], runs[True]
    assert compiled.compiled and not eager.compiled and built == 2
    for i, (a, b) in enumerate(zip(compiled.streams, eager.streams)):
        assert a.tokens == b.tokens, f"stream {i}"
    assert compiled.accepted == eager.accepted


def _kernels_built_by_new_capacities(rt) -> set:
    """Fused kernels that decodes at new capacities add to MLX's kernel cache.

    Every path measured (MTP and plain decoding) is first run at one
    capacity, so whatever the cache held before (a fresh machine's is
    empty) only the kernels a new capacity needs are counted.
    """
    from mtplx_ext.cache.compiled_step import mlx_kernel_cache_dir

    cache_dir = mlx_kernel_cache_dir()

    def decode(prompt: list[int]) -> None:
        generate_greedy_batched(rt, [prompt], max_new_tokens=5, depth=1)
        generate_greedy_batched(rt, [prompt], max_new_tokens=5, use_mtp_draft=False)

    decode([1, 2, 3])
    if not cache_dir.is_dir():
        pytest.skip("MLX keeps no fused-kernel cache here")
    before = set(cache_dir.iterdir())
    for width in _unseen_widths(cache_dir, 2):
        decode([int(t) % rt.vocab_size for t in range(width)])
    return set(cache_dir.iterdir()) - before


def _unseen_widths(cache_dir, n: int) -> list[int]:
    """`n` prompt widths (hence capacities) this kernel cache has not been measured at: a warm cache would
    hide a baked value. The widths used are recorded beside the cache, so a replayed seed (the same first
    choice) still measures new ones."""
    record = cache_dir.parent / "mtplx-test-widths.json"
    seen = set(json.loads(record.read_text())) if record.is_file() else set()
    start = int(_seed.rng().integers(100, 1000))
    widths = [w for w in [*range(start, 4000), *range(100, start)] if w not in seen][:n]
    record.write_text(json.dumps(sorted(seen | set(widths))))
    return widths


def test_a_new_capacity_builds_no_new_fused_kernel():
    # MLX bakes scalar constants into the fused kernels of a compiled graph
    # and compiles (C++ on the CPU backend) every new variant: a capacity in
    # the step's graph would cost a compiler run for each prompt length.
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    assert _kernels_built_by_new_capacities(rt) == set()


def test_the_kernel_count_sees_a_capacity_baked_into_the_step(monkeypatch):
    # The check above must be able to fail: clamp writes with a Python
    # scalar (the capacity baked into the graph) instead of the last-slot
    # input, and new capacities must build new kernels.
    from mtplx_ext.cache.ragged import RaggedPositions

    real_apply = RaggedPositions.apply

    def apply_with_a_baked_clamp(self, kind, arg):
        held = self.last_slot
        if held is not None:
            self.last_slot = self.capacity - 1  # a Python scalar: a constant of the trace
        try:
            real_apply(self, kind, arg)
        finally:
            self.last_slot = held

    monkeypatch.setattr(RaggedPositions, "apply", apply_with_a_baked_clamp)
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    assert _kernels_built_by_new_capacities(rt), "a baked capacity built no new kernel: the check is blind"


@pytest.mark.parametrize("mtp", [False, True])
def test_compiled_caches_grow_in_steps_and_keep_the_eager_tokens(mtp, monkeypatch):
    # A small growth step forces several reallocations (and re-traces)
    # within one decode; tokens must not notice.
    import mtplx_ext.decode.cycle as decode

    monkeypatch.setattr(decode, "COMPILED_GROW_STEP", int(_seed.rng().integers(3, 7)))
    rng = _seed.rng()
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    prompts = [rng.integers(0, rt.vocab_size, size=int(n)).tolist() for n in rng.integers(2, 9, size=3)]
    runs = {}
    for eager in (False, True):
        counting = CountingForwards(rt)
        r = generate_greedy_batched(counting, prompts, max_new_tokens=30, use_mtp_draft=mtp, enforce_eager=eager, depth=1)
        runs[eager] = (r, counting.calls)
    (compiled, built), (eager, _) = runs[False], runs[True]
    assert compiled.compiled and built > 3, "the caches never grew"
    for i, (a, b) in enumerate(zip(compiled.streams, eager.streams)):
        assert a.tokens == b.tokens, f"stream {i}"


def test_reserve_grows_every_layer_by_whole_steps_and_keeps_their_contents():
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    cache = rt.make_cache([1, 0], ragged=True, capacity=6)
    rt.forward(mx.array([[0, 5, 6], [7, 8, 9]], dtype=mx.int32), cache)
    before = [np.array(c.keys) for c in cache]
    step = CompiledStep(lambda t: t + 1, [cache], grow_step=5)
    step.reserve(6)
    assert [c.keys.shape[2] for c in cache] == [6] * len(cache)
    step.reserve(12)
    assert cache[0].positions.capacity == 16
    for c, b in zip(cache, before):
        assert c.keys.shape[2] == c.values.shape[2] == 16
        np.testing.assert_array_equal(np.array(c.keys)[:, :, :6], b)
        assert not np.array(c.keys)[:, :, 6:].any()
    with pytest.raises(ValueError, match="can only grow"):
        cache[0].positions.set_capacity(8)


_RT: dict = {}


def _shared_runtime(model_type: str):
    # One model per family for every example (a fresh seed per session).
    if model_type not in _RT:
        _RT[model_type] = mtplx_ext.init_random(model_type, seed=fresh_seed(), vocab_size=48)
    return _RT[model_type]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    model_type=st.sampled_from(["qwen3", "qwen3_next"]),
    mode=st.sampled_from([dict(use_mtp_draft=False), dict(), dict(reject_mode="reforward")]),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    max_new=st.integers(1, 20),
    grow=st.integers(1, 6),
    serial=st.booleans(),
    sampled=st.booleans(),
    data=st.data(),
)
def test_compiled_decoding_equals_eager_decoding_for_any_batch(
    monkeypatch, model_type, mode, lengths, max_new, grow, serial, sampled, data
):
    # Ragged prompts, caps that fall inside a cycle, stop tokens that end
    # some streams early, caches that must grow mid-decode, greedy or sampled.
    import mtplx_ext.decode.cycle as decode

    monkeypatch.setattr(decode, "COMPILED_GROW_STEP", grow)
    rt = _shared_runtime(model_type)
    V = rt.vocab_size
    prompts = [data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n)) for n in lengths]
    stops = data.draw(st.sets(st.integers(0, V - 1), max_size=2))
    kw = dict(max_new_tokens=max_new, stop_token_ids=stops, serial=serial, **mode)
    if sampled:
        from mtplx_ext import SamplerConfig

        cfg = SamplerConfig(temperature=0.9, top_p=0.9, presence_penalty=0.3)
        kw.update(sampler=cfg, seed=data.draw(st.integers(0, 99)))
    compiled = generate_batched(rt, prompts, **kw, depth=1)
    eager = generate_batched(rt, prompts, enforce_eager=True, **kw, depth=1)
    assert compiled.compiled
    assert [s.tokens for s in compiled.streams] == [s.tokens for s in eager.streams]
    assert [s.finish_reason for s in compiled.streams] == [s.finish_reason for s in eager.streams]
    assert (compiled.cycles, compiled.forwards, compiled.accepted) == (eager.cycles, eager.forwards, eager.accepted)


@pytest.mark.parametrize("kw", [dict(depth=3), dict(reject_mode="reforward", depth=2), dict(use_mtp_draft=False, depth=1)])
def test_a_later_decode_of_the_same_shapes_replays_the_steps_and_keeps_its_own_tokens(kw):
    # Steps are kept between decodes of one runtime: another batch of the
    # same shapes (other prompts and paddings) must replay them without
    # Python building a forward, and still decode its own prompts; new
    # weights must make them trace again.
    rng = _seed.rng()
    counting = CountingForwards(mtplx_ext.init_random("qwen3", seed=fresh_seed()))
    V = counting.vocab_size
    width = int(rng.integers(6, 10))

    def batch() -> list[list[int]]:
        lengths = [width] + rng.integers(1, width + 1, size=2).tolist()
        return [rng.integers(0, V, size=int(n)).tolist() for n in lengths]

    def both(prompts):
        eager = generate_greedy_batched(counting.rt, prompts, max_new_tokens=12, enforce_eager=True, **kw)
        before = counting.calls
        r = generate_greedy_batched(counting, prompts, max_new_tokens=12, **kw)
        assert [s.tokens for s in r.streams] == [s.tokens for s in eager.streams]
        return counting.calls - before

    # The prefill (one forward here) is always built in Python.
    assert both(batch()) > 1
    assert both(batch()) == 1, "a decode of the same shapes built its steps again"
    counting.rt.update(mtplx_ext.init_random("qwen3", seed=fresh_seed()).parameters())  # new weights
    assert both(batch()) > 1, "steps traced with the old weights were replayed"


def test_kept_steps_go_with_their_runtime():
    # Kept steps hold traced graphs (and so the weights): a dropped runtime
    # must not stay alive through them.
    import gc
    import weakref

    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    generate_greedy_batched(rt, [[1, 2, 3], [4]], max_new_tokens=8, depth=2)
    assert rt.mtplx_kept_steps.steps, "the decode kept no step"
    gone = weakref.ref(rt)
    del rt
    gc.collect()
    assert gone() is None, "a kept step keeps its runtime alive"


@pytest.mark.parametrize("family,kw", [("qwen3", {}), ("qwen3_next", {}), ("deepseek_v3", {"head_layout": "deepseek"})])
def test_weight_ids_are_the_ids_mlx_parameters_lists_and_follow_a_replaced_weight(family, kw):
    from mlx.utils import tree_flatten, tree_unflatten
    from _greedy import _runtime

    from mtplx_ext.cache.compiled_step import weight_ids

    rt = _runtime(family, _seed.rng(), **kw)
    rt.scratch_list = [mx.zeros((2,)), {"w": mx.ones((3,)), "note": "text"}]  # nested containers
    rt._private = mx.zeros((4,))  # not a parameter (leading underscore)
    want = tuple(id(a) for _, a in tree_flatten(rt.parameters()))
    assert weight_ids(rt) == want and len(want) > 10
    name, old = tree_flatten(rt.parameters())[3]
    rt.update(tree_unflatten([(name, old + 1)]), strict=False)
    assert weight_ids(rt) != want and weight_ids(rt) == tuple(id(a) for _, a in tree_flatten(rt.parameters()))
