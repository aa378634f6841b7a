"""Inputs at the edges of the public API: each works as documented or fails naming the argument.

SamplerConfig fields are drawn from the whole float64 range (finite, Inf,
NaN, and float32's edges on purpose): a value either raises ValueError
naming the field or samples token for token as the float64 reference does.
Which values must be accepted is stated here independently of the code: the
kernels read float32, so a float field is accepted exactly when it is in its
documented range and, rounded to float32, is 0 or a normal number.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.decode.policies import SampledPolicy
from mtplx_ext.ops.sampled_verify import row_uniforms
from mtplx_ext.sampling import PARAM_COLUMNS, counts_with, row_is_valid, sample_from, transform_row
from _ragged import fresh_seed
from test_sampling_fused import cdf_ambiguous, host, kept_ambiguous, random_config, random_logits
import _seed

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
FLOAT_FIELDS = tuple(n for n in PARAM_COLUMNS if n != "top_k")
# Documented ranges besides the float32 rule (NaN fails each comparison).
IN_RANGE = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "presence_penalty": lambda v: not math.isnan(v),
    "frequency_penalty": lambda v: not math.isnan(v),
    "repetition_penalty": lambda v: v > 0,
}
# float32's edges and the values the issue found.
EDGES = (
    0.0, 1.0, 3e38, 1e39, 1e-50, 1e-40, 1e-45, 5e-324, 1.7976931348623157e308,
    F32_MAX, 3.4028235e38,
    F32_MAX * (1 + 2**-25), F32_MAX * (1 + 2**-23), F32_TINY, float(np.nextafter(F32_TINY, 0.0)),
    F32_TINY * (1 - 2**-25), float(np.nextafter(1.0, 2.0)), math.inf, math.nan,
)


def documented_float(name: str, v: float) -> bool:
    """Whether the docs promise that field `name` takes the value `v`."""
    if not IN_RANGE[name](v):
        return False
    if v == 0:
        return True
    with np.errstate(over="ignore", under="ignore"):
        f = abs(float(np.float32(v)))
    return F32_TINY <= f <= F32_MAX


any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EDGES).flatmap(lambda x: st.sampled_from((x, -x))),
)
any_top_k = st.one_of(st.integers(-(2**70), 2**70), st.integers(2**24 - 3, 2**24 + 3), st.integers(0, 40), any_float)


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(PARAM_COLUMNS),
    data=st.data(),
    case_seed=st.integers(0, 2**32 - 1),
)
def test_sampler_fields_over_the_whole_float64_range_raise_naming_the_field_or_sample_as_the_reference(
    field, data, case_seed
):
    rng = np.random.default_rng(case_seed)
    V, B = 24, 8
    value = data.draw(any_top_k if field == "top_k" else any_float, label=field)
    base = random_config(rng, V)
    kwargs = {n: getattr(base, n) for n in PARAM_COLUMNS} | {field: value}
    if field == "top_k":
        ok = isinstance(value, int) and 0 <= value < 2**24
    else:
        ok = documented_float(field, value)
    if not ok:
        with pytest.raises(ValueError) as e:
            SamplerConfig(**kwargs)
        msg = str(e.value)
        assert msg.startswith(f"SamplerConfig.{field} must be ") and "\n" not in msg, msg
        event("rejected")
        return
    cfg = SamplerConfig(**kwargs)
    assert getattr(cfg, field) == value
    logits = random_logits(rng, (B, V), mx.float32)
    counts = (rng.integers(0, 4, size=(B, V)) * (rng.random((B, V)) < 0.3)).astype(np.int32)
    extra = rng.integers(-1, V, size=(B, 1)).astype(np.int32)
    u = rng.random(B).astype(np.float32)
    out = np.array(
        mtplx_ext.sample_tokens(logits, mx.array(u), cfg, token_counts=mx.array(counts), extra_tokens=mx.array(extra))
    )
    lg = host(logits)
    compared = 0
    for b in range(B):
        if not row_is_valid(lg[b]):
            assert out[b] == -1
            continue
        c = counts_with(counts[b], V, [t for t in extra[b] if t >= 0])
        p = transform_row(lg[b], cfg, c).p
        assert np.isfinite(p).all() and p.sum() == pytest.approx(1.0)
        if kept_ambiguous(lg[b], cfg, c) or cdf_ambiguous(p, u[b]):
            continue
        assert out[b] == sample_from(p, u[b]), (b, cfg)
        compared += 1
    event(f"accepted, {min(compared, 4)}{'+' if compared >= 4 else ''} rows compared")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 1e39),
        ("temperature", 1e-50),
        ("presence_penalty", 1e39),
        ("frequency_penalty", -1e39),
        ("repetition_penalty", 1e39),
        ("repetition_penalty", 1e-50),
        ("min_p", 1e-45),
        ("top_p", 1e-50),
    ],
)
def test_sampler_values_that_overflow_or_vanish_in_float32_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^SamplerConfig\.{field} must be .*float32") as e:
        SamplerConfig(**{field: value})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 3e38), ("temperature", 3.4028235e38), ("temperature", F32_TINY), ("presence_penalty", -3e38),
     ("frequency_penalty", 2e-38), ("repetition_penalty", F32_TINY), ("min_p", F32_TINY), ("top_p", F32_TINY)],
)
def test_sampler_values_at_the_edges_of_float32s_normal_range_are_kept(field, value):
    assert getattr(SamplerConfig(**{field: value}), field) == value


@pytest.mark.parametrize("bad", [1.5, 2.0, np.float64(3.0), np.float32(1.0), True, np.bool_(False), "7"])
def test_seeds_that_are_not_ints_are_rejected_naming_the_argument(bad):
    rt = mtplx_ext.init_random("qwen3", fresh_seed(), vocab_size=64, num_hidden_layers=1)
    sampler = SamplerConfig(temperature=0.8)
    with pytest.raises(TypeError, match=r"^row_seeds\[1\] must be an int"):
        mtplx_ext.generate_batched(rt, [[1], [2]], max_new_tokens=2, sampler=sampler, row_seeds=[4, bad], depth=1)
    with pytest.raises(TypeError, match=r"^seed must be an int"):
        mtplx_ext.generate_batched(rt, [[1]], max_new_tokens=2, sampler=sampler, seed=bad, depth=1)
    # Checked on the greedy path too, where the seeds go unused.
    with pytest.raises(TypeError, match=r"^seed must be an int"):
        mtplx_ext.generate_batched(rt, [[1]], max_new_tokens=2, seed=bad, depth=1)
    with pytest.raises(TypeError, match=r"^row_seeds\[0\] must be an int"):
        SampledPolicy(sampler, row_seeds=[bad])
    with pytest.raises(ValueError, match=r"^row_seeds\[0\] must be an int in \[0, 2\*\*64\)"):
        SampledPolicy(sampler, row_seeds=[-1])


def test_numpy_integers_decode_as_python_ints_do_compiled_and_sampled():
    rng = _seed.rng()
    # The default test model: its compiled kernels are the ones other tests build too.
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed())
    V = rt.vocab_size
    prompts = [rng.integers(0, V, size=int(n)).tolist() for n in rng.integers(1, 6, size=3)]
    n = int(rng.integers(2, 7))
    want = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=n, depth=1)
    got = mtplx_ext.generate_greedy_batched(rt, [np.array(p) for p in prompts], max_new_tokens=np.int64(n), depth=1)
    assert got.compiled and [s.tokens for s in got.streams] == [s.tokens for s in want.streams]
    # Seeds and max_new_tokens become Python ints up front; eager steps keep this part cheap.
    seeds = rng.integers(0, 2**63, size=3)
    sampler = SamplerConfig(temperature=0.9, top_k=np.int32(20))
    run = lambda **kw: [  # noqa: E731
        s.tokens for s in mtplx_ext.generate_batched(rt, prompts, sampler=sampler, enforce_eager=True, **kw, depth=1).streams
    ]
    assert run(max_new_tokens=np.int32(n), row_seeds=seeds.astype(np.uint64)) == run(
        max_new_tokens=n, row_seeds=seeds.tolist()
    )
    assert run(max_new_tokens=n, seed=np.uint64(seeds[0])) == run(max_new_tokens=n, seed=int(seeds[0]))


def test_numpy_numbers_work_where_python_numbers_do_in_the_other_entry_points(tmp_path):
    rng = _seed.rng()
    cfg = SamplerConfig(temperature=np.float32(0.5), top_k=np.int16(5), top_p=np.float64(0.9))
    assert cfg == SamplerConfig(temperature=0.5, top_k=5, top_p=0.9) and type(cfg.top_k) is int
    x = mx.array(rng.normal(size=(2, 3, 4, 8)).astype(np.float32))
    o = int(rng.integers(0, 100))
    want = mtplx_ext.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=o)
    got = mtplx_ext.rope(x, np.int32(8), traditional=False, base=np.float32(10000), scale=np.int64(1), offset=np.int64(o))
    assert mx.array_equal(got, want)
    assert mx.array_equal(mtplx_ext.rms_norm(x, None, np.float32(1e-5)), mtplx_ext.rms_norm(x, None, float(np.float32(1e-5))))
    seed = fresh_seed()
    a = mtplx_ext.init_random("qwen3", np.int64(seed), hidden_size=np.int64(32), num_hidden_layers=np.int32(1))
    b = mtplx_ext.init_random("qwen3", seed, hidden_size=32, num_hidden_layers=1)
    assert all(mx.array_equal(p, q) for (_, p), (_, q) in zip(tree_flatten(a.parameters()), tree_flatten(b.parameters())))
    a.save(tmp_path / "m")  # the config (JSON) holds the overrides as plain ints
    assert mtplx_ext.load(tmp_path / "m").config["hidden_size"] == 32
    caches = a.make_cache(np.array([2, 0]), ragged=True, capacity=np.int64(16))
    assert caches[0].positions.capacity == 16 and type(caches[0].positions.capacity) is int
    assert row_uniforms(mx.random.key(seed)[None], np.int64(3)).shape == (1, 3)


@pytest.mark.parametrize("name, call", [
    ("left_padding[1]", lambda rt: rt.make_cache([0, 1.5])),
    ("capacity", lambda rt: rt.make_cache([0], ragged=True, capacity=8.0)),
    ("max_new_tokens", lambda rt: mtplx_ext.generate_greedy_batched(rt, [[1]], max_new_tokens=3.0, depth=1)),
    ("seed", lambda rt: mtplx_ext.init_random("qwen3", 1.5)),
])
def test_floats_where_ints_are_taken_are_rejected_naming_the_argument(name, call):
    rt = mtplx_ext.init_random("qwen3", fresh_seed(), vocab_size=64, num_hidden_layers=1)
    with pytest.raises(TypeError, match=rf"^{re.escape(name)} must be an int"):
        call(rt)


def _sampled_args(B: int, V: int) -> tuple:
    return (mx.zeros((B, 2, V)), mx.zeros((B, V)), mx.zeros((B, 2), mx.int32), mx.zeros((B, 3)))


@pytest.mark.parametrize("sampler", [SamplerConfig(), [], mx.zeros((0, 7))], ids=["config", "empty list", "packed"])
def test_sampling_primitives_with_no_rows_name_the_logits(sampler):
    V = int(_seed.rng().integers(1, 50))
    with pytest.raises(ValueError, match=r"^logits must have at least one row") as e:
        mtplx_ext.sample_tokens(mx.zeros((0, V)), mx.zeros((0,)), sampler)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^verify_logits must have at least one row"):
        mtplx_ext.verify_sampled(*_sampled_args(0, V), sampler)


@pytest.mark.parametrize("sampler", [None, 5, 0.7, "greedy"])
def test_sampling_primitives_without_a_sampler_config_name_the_sampler(sampler):
    V = int(_seed.rng().integers(1, 50))
    with pytest.raises(TypeError, match=r"^sampler must be a SamplerConfig"):
        mtplx_ext.sample_tokens(mx.zeros((2, V)), mx.zeros((2,)), sampler)
    with pytest.raises(TypeError, match=r"^sampler must be a SamplerConfig"):
        mtplx_ext.verify_sampled(*_sampled_args(2, V), sampler)
