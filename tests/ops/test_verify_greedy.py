"""verify_greedy against a float64 numpy reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.ops.greedy_verify import COL_ACCEPT, COL_BONUS, COL_DRAFT, COL_SECOND, COL_X0
from _poison import poison_allocator
import _seed

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def reference_bundle(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """float64 reference: argmax (first max), invalid rows and tokens -> -1."""
    B, _, V = logits.shape
    out = np.empty((B, 5), dtype=np.int64)
    for b in range(B):
        picks, valid = [], True
        for p in range(2):
            row = logits[b, p]
            bad = np.isnan(row).any() or np.isposinf(row).any() or np.all(np.isneginf(row))
            valid &= not bad
            picks.append(-1 if bad else int(np.argmax(row)))
        x0, draft = int(tokens[b, 0]), int(tokens[b, 1])
        x0_ok, draft_ok = 0 <= x0 < V, 0 <= draft < V
        out[b, COL_X0] = x0 if x0_ok else -1
        out[b, COL_DRAFT] = draft if draft_ok else -1
        out[b, COL_SECOND] = picks[0]
        out[b, COL_BONUS] = picks[1]
        ok = valid and x0_ok and draft_ok
        out[b, COL_ACCEPT] = int(draft == picks[0]) if ok else -1
    return out


def run_fused(logits64: np.ndarray, tokens: np.ndarray, dtype) -> np.ndarray:
    x = mx.array(logits64.astype(np.float32)).astype(dtype)
    t = mx.array(tokens)
    mx.eval(x, t)
    poison_allocator(logits64.shape[0] * 5 * 4)
    out = mtplx_ext.verify_greedy(x, t)
    mx.eval(out)
    assert out.dtype == mx.int32 and tuple(out.shape) == (logits64.shape[0], 5)
    return np.array(out), np.array(x.astype(mx.float32)).astype(np.float64)


def random_case(rng: np.random.Generator, B: int, V: int):
    logits = rng.standard_normal((B, 2, V)) * rng.uniform(0.5, 4.0)
    tokens = rng.integers(0, V, size=(B, 2))
    # About half the drafts are right so both accept outcomes are exercised.
    hit = rng.random(B) < 0.5
    tokens[hit, 1] = np.argmax(logits[hit, 0], axis=-1)
    return logits, tokens


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("V", [2, 1000, 32000, 151936])
@pytest.mark.parametrize("B", [1, 3, 8, 33])
def test_bundle_matches_float64_reference(B, V, dtype):
    rng = _seed.rng()
    logits, tokens = random_case(rng, B, V)
    got, seen = run_fused(logits, tokens, DTYPES[dtype])
    # The reference sees exactly the values the kernel saw (after rounding).
    np.testing.assert_array_equal(got, reference_bundle(seen, tokens))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_exact_ties_go_to_lowest_index(dtype):
    rng = _seed.rng()
    B, V = 16, 4099
    logits, tokens = random_case(rng, B, V)
    for b in range(B):
        for p in range(2):
            top = logits[b, p].max() + 1.0
            where = rng.choice(V, size=rng.integers(2, 6), replace=False)
            logits[b, p, where] = top
    logits[0, 0, :] = 0.0  # a row that is all one tie
    logits[1, 1, :3] = [-0.0, 0.0, -1.0]
    logits[1, 1, 3:] = -5.0  # -0 and +0 tie: the first one wins
    tokens[2, 1] = int(np.flatnonzero(logits[2, 0] == logits[2, 0].max())[0])
    got, seen = run_fused(logits, tokens, DTYPES[dtype])
    np.testing.assert_array_equal(got, reference_bundle(seen, tokens))
    assert got[0, COL_SECOND] == 0 and got[1, COL_BONUS] == 0
    assert got[2, COL_ACCEPT] == 1


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nonfinite_rows_flag_accept_invalid(dtype):
    rng = _seed.rng()
    B, V = 12, 3001
    logits, tokens = random_case(rng, B, V)
    pos = lambda: int(rng.integers(0, V))  # noqa: E731
    logits[0, 0, pos()] = np.nan
    logits[1, 1, pos()] = np.nan
    logits[2, 0, pos()] = np.inf
    logits[3, 1, :] = -np.inf
    logits[4, 0, pos()] = -np.nan  # sign bit set: sorts below -inf as bits
    logits[5, 0, : V // 2] = -np.inf  # -inf entries alone are fine
    logits[6, 1, pos()] = -np.inf
    got, seen = run_fused(logits, tokens, DTYPES[dtype])
    np.testing.assert_array_equal(got, reference_bundle(seen, tokens))
    assert (got[:5, COL_ACCEPT] == -1).all()
    assert (got[5:, COL_ACCEPT] >= 0).all()


@pytest.mark.parametrize("tok_dtype", [np.int32, np.int64, np.int16, np.uint32])
def test_tokens_at_and_beyond_vocabulary_edges(tok_dtype):
    rng = _seed.rng()
    V = 1000
    logits, _ = random_case(rng, 6, V)
    tokens = np.array(
        [[0, V - 1], [V - 1, 0], [V, 0], [0, V], [-1, 3], [3, -1]], dtype=np.int64
    )
    if tok_dtype == np.uint32:
        tokens = np.abs(tokens)
    tokens = tokens.astype(tok_dtype)
    got, seen = run_fused(logits, tokens, mx.float32)
    np.testing.assert_array_equal(got, reference_bundle(seen, tokens.astype(np.int64)))
    assert (got[:2, COL_ACCEPT] >= 0).all()


def test_int64_tokens_never_wrap_into_the_vocabulary():
    rng = _seed.rng()
    V = 512
    logits, _ = random_case(rng, 3, V)
    tokens = np.array([[2**32 + 1, 1], [1, 2**32 + 7], [-(2**32) + 3, 2]], dtype=np.int64)
    got, _ = run_fused(logits, tokens, mx.float32)
    assert (got[:, COL_ACCEPT] == -1).all()


def test_strided_and_sliced_logits_are_read_correctly():
    rng = _seed.rng()
    B, T, V = 5, 4, 777
    full = rng.standard_normal((B, T, V)).astype(np.float32)
    x = mx.array(full)[:, 1:3, :]  # a view, not row contiguous
    tokens = rng.integers(0, V, size=(B, 2))
    out = np.array(mtplx_ext.verify_greedy(x, mx.array(tokens)))
    np.testing.assert_array_equal(out, reference_bundle(full[:, 1:3].astype(np.float64), tokens))
    xt = mx.array(np.ascontiguousarray(np.swapaxes(full[:, :2], 1, 2)))
    out_t = np.array(mtplx_ext.verify_greedy(mx.swapaxes(xt, 1, 2), mx.array(tokens)))
    np.testing.assert_array_equal(out_t, reference_bundle(full[:, :2].astype(np.float64), tokens))


def test_runs_on_explicit_cpu_stream():
    rng = _seed.rng()
    logits, tokens = random_case(rng, 2, 64)
    out = mtplx_ext.verify_greedy(mx.array(logits.astype(np.float32)), mx.array(tokens), stream=mx.cpu)
    np.testing.assert_array_equal(np.array(out), reference_bundle(logits.astype(np.float32).astype(np.float64), tokens))


@pytest.mark.parametrize(
    "logits_shape,tokens_shape,name",
    [
        ((4, 3, 10), (4, 2), "verify_logits"),
        ((4, 10), (4, 2), "verify_logits"),
        ((4, 2, 0), (4, 2), "verify_logits"),
        ((4, 2, 10), (3, 2), "tokens"),
        ((4, 2, 10), (4,), "tokens"),
        ((4, 2, 10), (4, 3), "tokens"),
    ],
)
def test_bad_shapes_raise_naming_the_argument(logits_shape, tokens_shape, name):
    with pytest.raises(ValueError, match=name):
        mtplx_ext.verify_greedy(mx.zeros(logits_shape), mx.zeros(tokens_shape, dtype=mx.int32))


def test_bad_dtypes_raise_naming_the_argument():
    with pytest.raises(TypeError, match="verify_logits"):
        mtplx_ext.verify_greedy(mx.zeros((2, 2, 5), dtype=mx.int32), mx.zeros((2, 2), dtype=mx.int32))
    with pytest.raises(TypeError, match="tokens"):
        mtplx_ext.verify_greedy(mx.zeros((2, 2, 5)), mx.zeros((2, 2)))
    with pytest.raises(TypeError, match="verify_logits"):
        mtplx_ext.verify_greedy(np.zeros((2, 2, 5)), mx.zeros((2, 2), dtype=mx.int32))


def test_cpp_op_checks_shapes_without_the_python_wrapper():
    from mtplx_ext import _ext

    with pytest.raises(ValueError, match="tokens"):
        _ext.verify_greedy(mx.zeros((2, 2, 5)), mx.zeros((3, 2), dtype=mx.int32))
    with pytest.raises(ValueError, match="verify_logits"):
        _ext.verify_greedy(mx.zeros((2, 5)), mx.zeros((2, 2), dtype=mx.int32))
