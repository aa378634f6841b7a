"""bandwidth: the read rate, weight bytes and the streaming floor."""

from __future__ import annotations

import math

import pytest

import mtplx_ext
from mtplx_ext.benchmark import bandwidth
from mtplx_ext.shipped import SHIPPED_MODEL


def test_read_bandwidth_is_a_plausible_rate():
    bw = bandwidth.read_bandwidth(nbytes=32 * 2**20, repeats=3)
    assert math.isfinite(bw) and 1e8 < bw < 1e13


def test_one_and_two_reading_threads_give_plausible_rates():
    for threads in (1, 2):
        bw = bandwidth.read_bandwidth(nbytes=32 * 2**20, repeats=3, threads=threads)
        assert math.isfinite(bw) and 1e8 < bw < 1e13


@pytest.mark.parametrize("kw, message", [(dict(nbytes=2), "nbytes"), (dict(nbytes=64, repeats=0), "repeats"),
                                         (dict(nbytes=64, threads=0), "threads")])
def test_read_bandwidth_rejects_bad_arguments(kw, message):
    with pytest.raises(ValueError, match=message):
        bandwidth.read_bandwidth(**kw)


def test_weight_bytes_counts_the_trunk_of_a_runtime_and_any_module():
    rt = mtplx_ext.load(SHIPPED_MODEL, fuse_cpu_ops=False)
    trunk = bandwidth.weight_bytes(rt)
    assert trunk == bandwidth.weight_bytes(rt.trunk)
    # The shipped trunk: float32, tied embedding counted once.
    c = rt.config
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = 2 * H * q + 2 * H * kv + 3 * H * I + 2 * H + 2 * c["head_dim"]
    assert trunk == 4 * (V * H + L * per_layer + H)
    assert bandwidth.weight_bytes(rt.head) > 0
    # Packed Linear layers count as stored: their zero-padded panels are read too.
    assert bandwidth.weight_bytes(mtplx_ext.load(SHIPPED_MODEL)) >= trunk


def test_streaming_floor():
    assert bandwidth.streaming_floor_s(2_000_000_000, 1e10) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="bandwidth"):
        bandwidth.streaming_floor_s(10, 0.0)
    with pytest.raises(ValueError, match="weight_bytes"):
        bandwidth.streaming_floor_s(-1, 1.0)
