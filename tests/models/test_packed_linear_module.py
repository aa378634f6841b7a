"""PackedLinear and pack_cpu_linears / unpack_cpu_linears on modules and runtimes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mtplx_ext
from mtplx_ext.models.packed_linear import (
    PackedLinear,
    linears_unpacked,
    pack_cpu_linears,
    packing_available,
    unpack_cpu_linears,
)
import _seed

pytestmark = pytest.mark.skipif(not packing_available(), reason="no vector FMA kernel on this CPU")


@pytest.fixture
def rng() -> np.random.Generator:
    seed = _seed.fresh()
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("bias", [False, True])
def test_module_matches_nn_linear(rng, bias: bool) -> None:
    lin = nn.Linear(70, 99, bias=bias)
    lin.update({k: mx.array(rng.standard_normal(v.shape).astype(np.float32)) for k, v in lin.parameters().items()})
    x = mx.array(rng.standard_normal((4, 3, 70)).astype(np.float32))
    p = PackedLinear.from_linear(lin)
    assert mx.array_equal(p.weight, lin.weight).item()
    x64 = np.array(x, dtype=np.float64)
    w64 = np.array(lin.weight, dtype=np.float64)
    ref = x64 @ w64.T + (np.array(lin.bias, dtype=np.float64) if bias else 0.0)
    bound = 72 * 2.0**-24 * (np.abs(x64) @ np.abs(w64).T + (np.abs(np.array(lin.bias)) if bias else 0.0))
    assert np.all(np.abs(np.array(p(x)) - ref) <= bound)
    back = p.to_linear()
    assert type(back) is nn.Linear and mx.array_equal(back.weight, lin.weight).item()
    if bias:
        assert mx.array_equal(back.bias, lin.bias).item()


def test_half_precision_inputs_promote_as_nn_linear_does(rng) -> None:
    lin = nn.Linear(40, 60)
    p = PackedLinear.from_linear(lin)
    for dtype in (mx.float16, mx.bfloat16):
        x = mx.array(rng.standard_normal((3, 40)).astype(np.float32)).astype(dtype)
        want = lin(x)
        got = p(x)
        assert got.dtype == want.dtype == mx.float32
        x64 = np.array(x.astype(mx.float32), dtype=np.float64)
        w64 = np.array(lin.weight, dtype=np.float64)
        ref = x64 @ w64.T + np.array(lin.bias, dtype=np.float64)
        bound = 42 * 2.0**-24 * (np.abs(x64) @ np.abs(w64).T + np.abs(np.array(lin.bias)))
        assert np.all(np.abs(np.array(got) - ref) <= bound)


def test_swap_packs_float32_linears_only_and_keeps_frozen_state() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = [nn.Linear(16, 16, bias=False), nn.QuantizedLinear(64, 32, bias=False)]
            self.c = nn.Linear(16, 4)
            self.c.set_dtype(mx.bfloat16)
            self.shared = self.a

    net = Net()
    net.b[0].freeze()
    before = {k: mx.array(v) for k, v in dict(tree_flatten(net.parameters())).items()}
    assert pack_cpu_linears(net) == 2
    assert isinstance(net.a, PackedLinear) and net.shared is net.a
    assert isinstance(net.b[0], PackedLinear) and type(net.b[1]) is nn.QuantizedLinear
    assert type(net.c) is nn.Linear
    assert "weight_packed" not in dict(tree_flatten(net.b[0].trainable_parameters()))
    assert unpack_cpu_linears(net) == 2
    after = dict(tree_flatten(net.parameters()))
    assert after.keys() == before.keys()
    assert all(mx.array_equal(after[k], before[k]).item() for k in before)
    assert "weight" not in dict(tree_flatten(net.b[0].trainable_parameters()))


def test_bad_model_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="model"):
        pack_cpu_linears({"a": nn.Linear(2, 2)})


def test_runtime_packs_on_load_and_saves_row_major(tmp_path, rng) -> None:
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), fuse_cpu_ops=True)
    assert rt.linears_packed
    plain = mtplx_ext.init_random("qwen3", seed=0, fuse_cpu_ops=False)
    assert not plain.linears_packed
    rt.save(tmp_path / "m")
    assert rt.linears_packed  # packed again after saving
    back = mtplx_ext.load(tmp_path / "m", fuse_cpu_ops=False)
    with linears_unpacked(rt):
        ours = dict(tree_flatten(rt.parameters()))
    theirs = dict(tree_flatten(back.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)


@pytest.mark.parametrize("kind", ["all_to_sharded", "sharded_to_all"])
def test_tensor_parallel_layers_are_packed_with_their_group(rng, kind: str) -> None:
    """On a group of one, all_sum is the identity: the packed shard equals mlx's layer."""
    from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear

    group = mx.distributed.init()
    lin = nn.Linear(56, 72)
    cls = AllToShardedLinear if kind == "all_to_sharded" else ShardedToAllLinear
    tp = cls.from_linear(lin, group=group)
    holder = nn.Module()
    holder.layer = tp
    assert pack_cpu_linears(holder) == 1
    p = holder.layer
    assert isinstance(p, PackedLinear) and p.sharded == kind and p.group is group
    x = mx.array(rng.standard_normal((5, 56)).astype(np.float32))
    x64 = np.array(x, dtype=np.float64)
    w64 = np.array(tp.weight, dtype=np.float64)
    ref = x64 @ w64.T + np.array(tp.bias, dtype=np.float64)
    bound = 58 * 2.0**-24 * (np.abs(x64) @ np.abs(w64).T + np.abs(np.array(tp.bias)))
    assert np.all(np.abs(np.array(p(x)) - ref) <= bound)
    assert unpack_cpu_linears(holder) == 1
    assert type(holder.layer) is cls and holder.layer.group is group
    assert mx.array_equal(holder.layer.weight, tp.weight).item()
    assert np.allclose(np.array(holder.layer(x)), np.array(tp(x)), rtol=0, atol=0)
