"""snapshot_state / restore_state: bit-exact device copies of state leaves."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from _poison import poison_allocator
import _seed


def bits(a: mx.array) -> np.ndarray:
    """The raw bytes of an array, so NaN payloads and -0 compare exactly."""
    return np.array(a.view(mx.uint8) if a.dtype != mx.bool_ else a.astype(mx.uint8))


def random_leaves(rng: np.random.Generator, B: int) -> list[mx.array]:
    """Leaves shaped like a hybrid model's recurrent state, mixed dtypes."""
    conv = rng.standard_normal((B, 3, 48)).astype(np.float32)
    conv.flat[rng.integers(0, conv.size)] = np.nan
    conv.flat[rng.integers(0, conv.size)] = -0.0
    ssm = rng.standard_normal((B, 2, 8, 16))
    return [
        mx.array(conv),
        mx.array(ssm.astype(np.float32)).astype(mx.bfloat16),
        mx.array(ssm[:, :1].astype(np.float16)),
        mx.array(rng.integers(-(2**31), 2**31 - 1, size=(B, 5), dtype=np.int64).astype(np.int32)),
        mx.array(rng.integers(0, 255, size=(B, 7), dtype=np.uint8)),
        mx.array(rng.random((B, 1)) < 0.5),
    ]


@pytest.mark.parametrize("B", [1, 4, 9])
def test_snapshot_is_bit_exact_for_mixed_leaves(B):
    rng = _seed.rng()
    leaves = random_leaves(rng, B)
    mx.eval(leaves)
    poison_allocator(sum(a.nbytes for a in leaves))
    snap = mtplx_ext.snapshot_state(leaves)
    assert len(snap) == len(leaves)
    for a, s in zip(leaves, snap):
        assert s.shape == a.shape and s.dtype == a.dtype
        np.testing.assert_array_equal(bits(s), bits(a))


def test_snapshot_of_views_copies_the_viewed_values():
    rng = _seed.rng()
    base = mx.array(rng.standard_normal((6, 10, 4)).astype(np.float32))
    views = [base[:, 2:7], mx.swapaxes(base, 1, 2), base[::2]]
    snap = mtplx_ext.snapshot_state(views)
    for v, s in zip(views, snap):
        np.testing.assert_array_equal(np.array(s), np.array(v))


@pytest.mark.parametrize("B", [1, 5, 16])
def test_restore_with_row_mask_restores_exactly_the_marked_rows(B):
    rng = _seed.rng()
    before = random_leaves(rng, B)
    snap = mtplx_ext.snapshot_state(before)
    live = random_leaves(rng, B)  # the state after a verification forward
    mask_np = rng.random(B) < 0.5
    mask_np[rng.integers(0, B)] = True
    mx.eval(snap, live)
    poison_allocator(sum(a.nbytes for a in live))
    out = mtplx_ext.restore_state(live, snap, mx.array(mask_np))
    for o, l, s in zip(out, live, snap):
        ob, lb, sb = bits(o), bits(l), bits(s)
        for b in range(B):
            np.testing.assert_array_equal(ob[b], sb[b] if mask_np[b] else lb[b])


def test_restore_without_mask_returns_the_snapshot():
    rng = _seed.rng()
    snap = mtplx_ext.snapshot_state(random_leaves(rng, 3))
    live = random_leaves(rng, 3)
    out = mtplx_ext.restore_state(live, snap)
    for o, s in zip(out, snap):
        np.testing.assert_array_equal(bits(o), bits(s))


def test_restore_leaves_its_inputs_unchanged():
    rng = _seed.rng()
    snap = mtplx_ext.snapshot_state(random_leaves(rng, 4))
    live = random_leaves(rng, 4)
    live_copy = [bits(a).copy() for a in live]
    mx.eval(mtplx_ext.restore_state(live, snap, mx.array([True, False, True, False])))
    for a, c in zip(live, live_copy):
        np.testing.assert_array_equal(bits(a), c)


def test_empty_lists_and_empty_leaves():
    assert mtplx_ext.snapshot_state([]) == []
    z = mx.zeros((3, 0, 4))
    (s,) = mtplx_ext.snapshot_state([z])
    assert s.shape == (3, 0, 4)
    (r,) = mtplx_ext.restore_state([z], [s], mx.array([True, False, True]))
    assert r.shape == (3, 0, 4)


def test_mismatched_leaves_raise_naming_the_argument():
    a = mx.zeros((2, 3))
    with pytest.raises(ValueError, match="snapshot"):
        mtplx_ext.restore_state([a, a], [a])
    with pytest.raises(ValueError, match=r"snapshot\[0\].*shape"):
        mtplx_ext.restore_state([a], [mx.zeros((2, 4))])
    with pytest.raises(ValueError, match="dtype"):
        mtplx_ext.restore_state([a], [a.astype(mx.float16)])
    with pytest.raises(ValueError, match="row_mask"):
        mtplx_ext.restore_state([a], [a], mx.array([True, False, True]))
    with pytest.raises(ValueError, match="row_mask"):
        mtplx_ext.restore_state([a], [a], mx.array([1, 0]))
    with pytest.raises(ValueError, match="row_mask"):
        mtplx_ext.restore_state([a], [a], mx.array([[True, False]]))
    with pytest.raises(ValueError, match=r"live\[0\]"):
        mtplx_ext.restore_state([mx.zeros(())], [mx.zeros(())], mx.array([True]))
    with pytest.raises(TypeError, match=r"arrays\[1\]"):
        mtplx_ext.snapshot_state([a, np.zeros(3)])
    with pytest.raises(TypeError, match="live"):
        mtplx_ext.restore_state(a, [a])
    with pytest.raises(TypeError, match="row_mask"):
        mtplx_ext.restore_state([a], [a], [True, False])
