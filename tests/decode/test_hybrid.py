"""Per-stream commit on hybrid trunks (qwen3_next, qwen3_5): captured
GatedDeltaNet states selected at each stream's accepted length, no repair.

* lossless vs mlx-lm's `generate_step` (which runs these models without
  speculation), batches 1 / 3 / 8, depths 1 / 2 / 3, greedy;
* pipelined == serial, compiled == eager;
* random per-stream accepted lengths applied to a captured batch leave every
  stream with the state (recurrent, conv, KV: checked through the next
  token's logits) of a fresh forward of its committed tokens alone;
* forwards == cycles at batch 8 with a random head, while "reforward" repairs;
* sampled decoding at depth 2 follows the model's joint distribution.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from _greedy import _prompts, check_stream, reference
from _stats import ALPHA_EXACT, g_test_pvalue
from mtplx_ext.cache import rollback as cache_state
from mtplx_ext.ops import gated_delta
from mtplx_ext.sampling import SamplerConfig, counts_with, distribution_from_logits
import _seed

FAMILIES = ["qwen3_next", "qwen3_5"]
#: Batched vs single-stream forwards of the float32 test models differ by
#: rounding only; states and logits agree to this (relative to 1 + |ref|),
#: far above the capture primitive's own 2e-5 (test_gated_delta.py).
STATE_TOL = 2e-4


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


def _rt(family: str, rng: np.random.Generator, **kw):
    return mtplx_ext.init_random(family, seed=int(rng.integers(1 << 30)), **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stream_equals_mlx_lm_greedy_decoding_at_batches_1_3_8_and_depths_1_2_3(rng, family):
    rt = _rt(family, rng)
    prompts = _prompts(rng, rt.vocab_size, 8)
    cap = 7
    refs = [reference(rt, p, cap) for p in prompts]
    for depth in (1, 2, 3):
        for B in (1, 3, 8):
            r = mtplx_ext.generate_greedy_batched(rt, prompts[:B], max_new_tokens=cap, depth=depth)
            assert r.repair_cycles == 0 and r.forwards == r.cycles, (depth, B)
            for i, s in enumerate(r.streams):
                check_stream(i, s, *refs[i], set(), cap)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipelined_equals_serial_and_compiled_equals_eager(rng, family):
    rt = _rt(family, rng)
    prompts = _prompts(rng, rt.vocab_size, 3)
    runs = {
        (serial, eager): mtplx_ext.generate_greedy_batched(
            rt, prompts, max_new_tokens=9, depth=2, serial=serial, enforce_eager=eager
        )
        for serial in (True, False)
        for eager in (True, False)
    }
    base = runs[(True, True)]
    for key, r in runs.items():
        assert [s.tokens for s in r.streams] == [s.tokens for s in base.streams], key
        assert (r.forwards, r.cycles, r.repair_cycles) == (base.forwards, base.cycles, 0), key
    assert runs[(False, False)].compiled and not runs[(True, True)].compiled


def _close(got: mx.array, ref: mx.array, what: str) -> None:
    g = np.array(got.astype(mx.float32), np.float64)
    r = np.array(ref.astype(mx.float32), np.float64)
    assert g.shape == r.shape, what
    err = np.max(np.abs(g - r) / (1 + np.abs(r)))
    assert err <= STATE_TOL, f"{what}: scaled error {err:.3g}"


def _fresh(rt, tokens: list[int]):
    cache = rt.make_cache([0])
    rt.forward(mx.array([tokens]), cache)
    cache_state.finish_prefill(cache)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_random_accepted_lengths_leave_each_stream_in_the_state_of_its_own_fresh_forward(rng, family):
    rt = _rt(family, rng)
    B, K = 5, 3
    prompts = _prompts(rng, rt.vocab_size, B, max_len=9)
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    cache = rt.make_cache(pads, ragged=True)
    rt.forward(mx.array([[0] * d + p for d, p in zip(pads, prompts)]), cache)
    cache_state.finish_prefill(cache)
    chunk = rng.integers(0, rt.vocab_size, (B, K + 1))
    accepted = rng.integers(0, K + 1, B)
    accepted[:2] = [0, K]  # both ends every time
    with gated_delta.route_gated_delta():
        with gated_delta.capture(cache_state.recurrent_caches(cache)) as cap:
            rt.forward(mx.array(chunk), cache)
        cache_state.commit_streams(cache, mx.array(accepted), K, cap)
        nxt = rng.integers(0, rt.vocab_size, (B, 1))
        logits, _ = rt.forward(mx.array(nxt), cache)
    rec = cache_state.recurrent_caches(cache)
    for b in range(B):
        committed = prompts[b] + chunk[b, : accepted[b] + 1].tolist()
        fresh = _fresh(rt, committed)
        # The recurrent layers' state after the next token, then that token's logits (KV included).
        f_logits, _ = rt.forward(mx.array([[int(nxt[b, 0])]]), fresh)
        for layer, (got, want) in enumerate(zip(rec, cache_state.recurrent_caches(fresh))):
            _close(got[0][b : b + 1], want[0], f"stream {b} layer {layer} conv state")
            _close(got[1][b : b + 1], want[1], f"stream {b} layer {layer} recurrent state")
        _close(logits[b : b + 1, -1], f_logits[:, -1], f"stream {b} next-token logits")


def test_a_state_selected_one_position_off_is_caught(rng):
    # The check above must be able to fail: committing n + 1 (or n - 1) for
    # one stream leaves it off its fresh forward's state.
    rt = _rt("qwen3_next", rng)
    K = 2
    prompt = rng.integers(0, rt.vocab_size, 4).tolist()
    chunk = rng.integers(0, rt.vocab_size, (1, K + 1))
    cache = _fresh(rt, prompt)
    with gated_delta.route_gated_delta():
        with gated_delta.capture(cache_state.recurrent_caches(cache)) as cap:
            rt.forward(mx.array(chunk), cache)
    lc = cap.of(cache_state.recurrent_caches(cache)[0])
    want = cache_state.recurrent_caches(_fresh(rt, prompt + chunk[0, :2].tolist()))[0]
    _close(lc.states[:, 1], want[1], "n = 1")
    for wrong in (0, 2):
        with pytest.raises(AssertionError, match="scaled error"):
            _close(lc.states[:, wrong], want[1], f"n = {wrong}")


def test_capture_outside_routing_or_of_an_unknown_cache_is_refused(rng):
    rt = _rt("qwen3_next", rng)
    cache = _fresh(rt, [1, 2, 3])
    with pytest.raises(RuntimeError, match="route_gated_delta"):
        with gated_delta.capture(cache_state.recurrent_caches(cache)):
            pass
    with gated_delta.route_gated_delta():
        with gated_delta.capture([]) as cap:
            with pytest.raises(RuntimeError, match="not one of the captured caches"):
                rt.forward(mx.array([[4]]), cache)
    with pytest.raises(KeyError, match="no gated-delta capture"):
        cap.of(cache_state.recurrent_caches(cache)[0])


def test_routing_is_undone_after_decoding(rng):
    import mlx.nn as nn
    import mlx_lm.models.qwen3_5 as q35
    import mlx_lm.models.qwen3_next as q3n
    from mlx_lm.models.gated_delta import gated_delta_update

    conv_call = nn.Conv1d.__call__
    with gated_delta.route_gated_delta() as names:
        assert "mlx_lm.models.qwen3_next" in names and "mlx_lm.models.qwen3_5" in names
        assert q3n.gated_delta_update is not gated_delta_update
    assert q3n.gated_delta_update is gated_delta_update and q35.gated_delta_update is gated_delta_update
    assert nn.Conv1d.__call__ is conv_call


@pytest.mark.parametrize("family", FAMILIES)
def test_at_batch_8_a_random_head_costs_one_forward_per_cycle_while_reforward_repairs(rng, family):
    rt = _rt(family, rng)
    prompts = _prompts(rng, rt.vocab_size, 8)
    per_stream = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=12, depth=2)
    uniform = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=12, depth=2, reject_mode="reforward")
    assert per_stream.accepted < per_stream.drafted  # the head is mostly wrong
    assert per_stream.forwards == per_stream.cycles and per_stream.repair_cycles == 0
    assert uniform.repair_cycles > 0 and uniform.forwards > uniform.cycles
    assert [s.tokens for s in per_stream.streams] == [s.tokens for s in uniform.streams]


def _expected_joint(rt, prompt: list[int], cfg: SamplerConfig, n: int) -> np.ndarray:
    """P(t_1..t_n) from full forwards of the trunk (float64), flat [V**n]."""
    V = rt.vocab_size
    joint, prefixes = np.ones(1), [[]]
    for _ in range(n):
        rows = np.array(rt.trunk(mx.array([prompt + p for p in prefixes]))[:, -1].astype(mx.float32), np.float64)
        step = np.stack([distribution_from_logits(rows[i], cfg, counts_with(None, V, p)) for i, p in enumerate(prefixes)])
        joint = (joint[:, None] * step).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(V)]
    return joint


def test_depth_2_sampling_on_a_hybrid_trunk_gives_the_models_joint_of_the_first_3_tokens(rng):
    V, depth = 6, 2
    n = depth + 1
    cfg = SamplerConfig(temperature=2.0, top_p=0.97, presence_penalty=0.4)
    rt = _rt("qwen3_next", rng, vocab_size=V)
    prompt = rng.integers(0, V, size=int(rng.integers(2, 6))).tolist()
    seeds = (int(rng.integers(1 << 40)) + np.arange(3000)).tolist()
    res = mtplx_ext.generate_batched(rt, [prompt] * len(seeds), max_new_tokens=n, sampler=cfg, row_seeds=seeds, depth=depth)
    assert res.repair_cycles == 0
    seqs = np.array([s.tokens for s in res.streams])
    assert res.reached[depth - 1] > 0, "no cycle reached the last draft"
    idx = np.ravel_multi_index(tuple(seqs.T), (V,) * n)
    p = g_test_pvalue(np.bincount(idx, minlength=V**n), _expected_joint(rt, prompt, cfg, n))
    assert p >= ALPHA_EXACT, f"hybrid depth-2 sampling off the model's distribution: p = {p:.2e}"
