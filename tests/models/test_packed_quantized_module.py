"""`pack_cpu_quantized` and the packed quantized modules: mlx-lm's layers in, the same layers out.

Random quantized models (fresh seed, printed). The shared products of
sibling layers (q / k / v, gate / up) must give each layer exactly the
columns it computes alone, in any call order, with no extra memory.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mtplx_ext
from mtplx_ext.models.packed_quantized import (
    PackedQuantizedLinear,
    SharedProduct,
    pack_cpu_quantized,
    unpack_cpu_quantized,
)
from mtplx_ext.ops import qlinear
import _seed


@pytest.fixture
def seed() -> int:
    s = int(_seed.rng().integers(1 << 30))
    print(f"model seed {s}")
    return s


def _model(seed: int, bits: int = 4, packed: bool = False):
    return mtplx_ext.init_random(
        "qwen3", seed=seed, fuse_cpu_ops=packed, quantize={"bits": bits, "group_size": 32},
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
    )


def _alone(m: PackedQuantizedLinear, x: mx.array) -> mx.array:
    return qlinear.packed_quantized_linear(x, m.wq, m.sb, m.output_dims, m.group_size, m.bits)


def test_siblings_share_one_product_and_each_gets_its_own_columns_in_any_order(seed: int) -> None:
    rt = _model(seed, packed=True)
    attn = rt.trunk.model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    assert isinstance(q.__dict__.get("_shared"), SharedProduct) and q._shared is k._shared is v._shared
    rng = np.random.default_rng(seed)
    x, x2 = (mx.array(rng.standard_normal((3, 128)).astype(np.float32)) for _ in range(2))
    want = {id(m): _alone(m, x) for m in (q, k, v)}
    # mlx-lm's order, then out of order, a member twice, and another input in between
    for order in ((q, k, v), (v, q, k), (k, k, q, v), (q, k)):
        for m in order:
            assert mx.array_equal(m(x), want[id(m)]).item()
        assert mx.array_equal(v(x2), _alone(v, x2)).item()
    mlp = rt.trunk.model.layers[0].mlp
    assert mlp.gate_proj._shared is mlp.up_proj._shared and "_shared" not in mlp.down_proj.__dict__


def test_packing_keeps_memory_and_unpacking_restores_mlx_layers_bit_for_bit(seed: int) -> None:
    rt, ref = _model(seed), _model(seed)
    before = sum(a.nbytes for _, a in tree_flatten(rt.parameters()))
    n = pack_cpu_quantized(rt)
    assert n > 0 and not any(type(m) is nn.QuantizedLinear for m in rt.modules())
    packed = sum(a.nbytes for _, a in tree_flatten(rt.parameters()))
    # Panels pad the output dimension; sharing adds nothing (members hold views).
    assert packed <= before * 1.05
    assert unpack_cpu_quantized(rt) == n
    got, want = dict(tree_flatten(rt.parameters())), dict(tree_flatten(ref.parameters()))
    assert got.keys() == want.keys()
    for name in want:
        assert mx.array_equal(got[name], want[name]).item(), name


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_packed_linear_matches_mlx_quantized_linear_within_the_rounding_bound(seed: int, bits: int) -> None:
    mx.random.seed(seed)
    lin = nn.QuantizedLinear(96, 130, bias=True, group_size=32, bits=bits)
    packed = PackedQuantizedLinear(lin)
    x = mx.random.normal((5, 96))
    ref = np.array(lin(x), np.float64)
    got = np.array(packed(x), np.float64)
    assert np.linalg.norm(got - ref) <= 0.02 * np.linalg.norm(ref)
    assert mx.array_equal(packed.to_quantized()(x), lin(x)).item()
