"""Token policies: rows loaded into a scheduler's policy draw as the same streams decoded alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtplx_ext.decode.policies import GreedyPolicy, SampledPolicy, row_keys
from mtplx_ext.sampling import SamplerConfig


def test_loaded_rows_draw_the_uniforms_of_a_policy_built_for_those_seeds(rng):
    B, V = 4, 32
    seeds = [int(s) for s in rng.integers(0, 2**63, B)]
    samplers = [SamplerConfig(temperature=float(t), top_k=int(k)) for t, k in zip(rng.uniform(0.2, 2, B), rng.integers(0, 8, B))]
    own = SampledPolicy(samplers, row_seeds=seeds)
    own.pick(mx.array(rng.normal(size=(B, V)).astype(np.float32)), 0)  # sets it up for B rows
    slots = SampledPolicy.slots(B, V, penalties=False)
    base = [int(b) for b in rng.integers(0, 1000, B)]
    slots.load_rows(seeds, samplers, base, mx.zeros((B,), mx.int32), None)
    for step in rng.integers(0, 10_000, 5):
        for position in (1, 2, 3):
            got = np.array(slots.uniforms(int(step), [0, 1, 2], position))
            for i, b in enumerate(base):
                # Row i counts its own steps from base[i]: its step s is the alone policy's s - base[i].
                want = np.array(own.uniforms(int(step) - b, [0, 1, 2], position))[i]
                np.testing.assert_array_equal(got[i], want)
    # The keys are the seeds', whichever rows sit next to them.
    np.testing.assert_array_equal(np.array(row_keys(seeds[1:2])), np.array(row_keys(seeds))[1:2])
    assert slots.unload_rows() is None and slots.x0 is None


def test_a_wrong_row_order_is_seen_by_the_same_check(rng):
    B, V = 3, 16
    seeds = [int(s) for s in rng.integers(0, 2**63, B)]
    samplers = [SamplerConfig(temperature=1.0)] * B
    own = SampledPolicy(samplers, row_seeds=seeds)
    own.pick(mx.array(rng.normal(size=(B, V)).astype(np.float32)), 0)
    slots = SampledPolicy.slots(B, V, penalties=False)
    slots.load_rows(seeds[::-1], samplers, [0] * B, mx.zeros((B,), mx.int32), None)
    assert not np.array_equal(np.array(slots.uniforms(5, [0])), np.array(own.uniforms(5, [0])))


def test_greedy_rows_carry_no_state():
    p = GreedyPolicy()
    p.load_rows([1, 2], [SamplerConfig()] * 2, [0, 0], mx.zeros((2,), mx.int32), None)
    assert p.unload_rows() is None
