"""`batching.batch.fit_drafts`: rows moving to a batch of another K keep their first drafts or get one-hot pads."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx_ext.batching.batch import fit_drafts


@pytest.mark.parametrize("have,want", [(4, 1), (1, 4), (2, 2), (3, 5)])
def test_drafts_are_cut_or_padded_with_one_hot_logits(rng, have: int, want: int) -> None:
    B, V = 3, 37
    nxt = mx.array(rng.integers(1, V, size=(B, have + 1)), dtype=mx.int32)
    info = mx.array(rng.standard_normal((B, have, V)).astype(np.float32))
    n, i = fit_drafts(nxt, info, want, V)
    assert n.shape == (B, want + 1) and i.shape == (B, want, V) and n.dtype == nxt.dtype
    keep = min(have, want)
    assert mx.array_equal(n[:, : keep + 1], nxt[:, : keep + 1]).item()
    assert mx.array_equal(i[:, :keep], info[:, :keep]).item()
    if want > have:
        assert (np.array(n[:, have + 1 :]) == 0).all()  # the pad token
        q = np.array(mx.softmax(i[:, have:], axis=-1))
        assert (q[..., 0] > 1 - 1e-6).all()  # the draft logits put all their mass on it (to float32)
    n2, i2 = fit_drafts(nxt, None, want, V)
    assert i2 is None and mx.array_equal(n2, n).item()
