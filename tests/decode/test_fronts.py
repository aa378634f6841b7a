"""The fixed-batch functions keep one set of settings: the greedy front takes every setting but the sampler's."""

from __future__ import annotations

import inspect

import numpy as np

import mtplx_ext

SAMPLER_ONLY = {"sampler", "seed", "row_seeds"}


def test_generate_greedy_batched_takes_every_setting_of_generate_batched_but_the_samplers():
    full = inspect.signature(mtplx_ext.generate_batched).parameters
    greedy = inspect.signature(mtplx_ext.generate_greedy_batched).parameters
    assert set(full) - SAMPLER_ONLY == set(greedy)
    for name, p in greedy.items():
        assert p.default == full[name].default, f"{name}: default {p.default!r} here, {full[name].default!r} there"


def test_the_greedy_front_passes_constraints_and_compaction_on():
    rt = mtplx_ext.init_random("qwen3", seed=3, vocab_size=64)

    class OnlyEven:  # a `Constraint` allowing the even tokens only
        def fork(self):
            return OnlyEven()

        def advance(self, tokens):
            odd = [i for i, t in enumerate(tokens) if t % 2]
            return odd[0] if odd else len(tokens)

        def rollback(self, n):
            pass

        def fill_mask(self, out):
            out[:] = np.array([0x55555555], np.uint32).view(np.int32)[0]

        def is_terminated(self):
            return False

    r = mtplx_ext.generate_greedy_batched(rt, [[1, 2, 3]], max_new_tokens=24, depth=1, constraints=[OnlyEven()])
    toks = r.streams[0].tokens
    assert len(toks) == 24 and all(t % 2 == 0 for t in toks), toks  # unconstrained: all even by chance ~2**-24
