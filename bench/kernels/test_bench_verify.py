"""verify_greedy (fused) vs stock MLX ops vs the host, B x V x dtype."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


def composed_mlx(logits: mx.array, tokens: mx.array) -> mx.array:
    """The same job from stock MLX ops: argmax, compare, stack."""
    picks = mx.argmax(logits, axis=-1).astype(mx.int32)
    accept = (picks[:, :1] == tokens[:, 1:]).astype(mx.int32)
    return mx.concatenate([tokens, picks[:, :1], accept, picks[:, 1:]], axis=1)


def host_numpy(logits: mx.array, tokens: mx.array) -> np.ndarray:
    """Copy the logits to the host and decide there (as float32)."""
    x = np.array(logits.astype(mx.float32))
    t = np.array(tokens)
    picks = x.argmax(axis=-1)
    accept = (picks[:, :1] == t[:, 1:]).astype(np.int32)
    return np.concatenate([t, picks[:, :1], accept, picks[:, 1:]], axis=1)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("V", [32000, 151936])
@pytest.mark.parametrize("B", [1, 8, 32])
@pytest.mark.parametrize("impl", ["fused", "composed_mlx", "host_numpy", "numpy_argmax"])
def test_verify_greedy_speed(record, impl, B, V, dtype):
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((B, 2, V)).astype(np.float32)).astype(DTYPES[dtype])
    tokens = mx.array(rng.integers(0, V, size=(B, 2)).astype(np.int32))
    mx.eval(logits, tokens)
    if impl == "fused":
        fn = lambda: mx.eval(mtplx_ext.verify_greedy(logits, tokens))  # noqa: E731
    elif impl == "composed_mlx":
        fn = lambda: mx.eval(composed_mlx(logits, tokens))  # noqa: E731
    elif impl == "host_numpy":
        fn = lambda: host_numpy(logits, tokens)  # noqa: E731
    else:
        # The floor: one numpy argmax over the same float32 bytes, already on the host.
        host = np.array(logits.astype(mx.float32))
        fn = lambda: host.argmax(axis=-1)  # noqa: E731
    # The fused result must equal the composed one before its speed counts.
    np.testing.assert_array_equal(
        np.array(mtplx_ext.verify_greedy(logits, tokens)), np.array(composed_mlx(logits, tokens))
    )
    record("verify_greedy", f"B={B} V={V} {dtype}", impl, fn)
