"""`batching.batch.fit_drafts`: rows moving to a batch of another K keep their first drafts or get one-hot pads."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx_ext.batching.batch import fit_drafts
import _seed


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


def test_padded_drafts_keep_sampled_verification_exact() -> None:
    """A row drafted at K = 1 verified at K = 3: its padded drafts (token 0, one-hot logits) commit draws from p.

    Each committed position is G-tested against the target's p at that
    position; a broken pad that keeps the head's logits beside the constant
    token (so q is not what drew it) commits too many zeros and is rejected.
    """
    from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue

    import mtplx_ext
    from mtplx_ext import SamplerConfig
    from mtplx_ext.decode.bundle import COL_N, COL_TOKENS

    rng = _seed.rng()
    B, K, V = 40_000, 3, 7
    vl = np.tile(rng.normal(size=(1, K + 1, V)) * 1.5, (B, 1, 1)).astype(np.float32)
    head = rng.normal(size=(1, 1, V)) * 1.5
    q = np.exp(head[0, 0]) / np.exp(head[0, 0]).sum()
    nxt = mx.array(np.stack([np.full(B, 3), rng.choice(V, size=B, p=q)], axis=1).astype(np.int32))
    info = mx.array(np.tile(head, (B, 1, 1)).astype(np.float32))
    tokens, fitted = fit_drafts(nxt, info, K, V)
    broken = mx.concatenate([fitted[:, :1], mx.array(np.tile(rng.normal(size=(1, K - 1, V)) * 1.5, (B, 1, 1))
                                                       .astype(np.float32))], axis=1)
    p = np.exp(vl[0].astype(np.float64))
    p /= p.sum(-1, keepdims=True)
    u = mx.array(rng.random((B, K + 2)).astype(np.float32))
    for draft_logits, exact in ((fitted, True), (broken, False)):
        b = np.array(mtplx_ext.verify_sampled_chain(mx.array(vl), draft_logits, tokens, u, SamplerConfig()))
        n = b[:, COL_N]
        pvals = [g_test_pvalue(np.bincount(b[n >= j, COL_TOKENS + j], minlength=V), p[j]) for j in range(K)]
        if exact:
            assert min(pvals) > ALPHA_EXACT, pvals
        else:
            assert min(pvals[1:]) < ALPHA_BROKEN, pvals
