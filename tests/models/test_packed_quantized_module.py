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
    PackedQuantizedEmbedding,
    PackedQuantizedLinear,
    SharedProduct,
    link_prefetch,
    pack_cpu_quantized,
    product_order,
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


def _products(rt, kinds: tuple = (PackedQuantizedLinear,)) -> set[int]:
    """Every distinct product of a packed model's layers of `kinds`: shared products, and layers outside one."""
    out = set()
    for _, m in rt.named_modules():
        if isinstance(m, kinds):
            out.add(id(m.__dict__.get("_shared") or m))
    return out


def _link(p) -> tuple:
    return p.prefetch if isinstance(p, SharedProduct) else p.__dict__.get("_prefetch", ())


def test_load_links_every_product_to_the_one_a_cycle_computes_next(seed: int) -> None:
    rt = _model(seed, packed=True)
    tokens = mx.array([[3]])

    def cycle() -> None:  # what load records: a one-token trunk step and its draft
        hidden = rt.forward(tokens)[1]
        rt.head_forward(hidden, tokens)

    order = product_order(cycle)
    # Every product of trunk and head; an embedding only as a tied LM head, which runs twice (trunk, head).
    ids = {id(p) for p in order}
    assert _products(rt) <= ids <= _products(rt, (PackedQuantizedLinear, PackedQuantizedEmbedding))
    assert len(order) >= 5 * rt.trunk.args.num_hidden_layers + 1
    after = {id(a): b for a, b in zip(order, order[1:] + order[:1])}  # a product's last use wins
    for a in order:
        pair, b = _link(a), after[id(a)]
        assert len(pair) == 2 and pair[0] is b.wq and pair[1] is b.sb
    # A model that links nothing (the broken variant) fails the check above.
    for p in order:
        if isinstance(p, SharedProduct):
            p.prefetch = ()
        else:
            p.__dict__.pop("_prefetch", None)
    assert not any(_link(p) for p in order)
    # Links change no result: logits with and without them are the same bits.
    tokens = mx.array([[1, 5, 9, 2]])
    plain = rt.trunk(tokens)
    assert link_prefetch(order) == len(order)
    assert all(_link(p) for p in order)
    assert mx.array_equal(rt.trunk(tokens), plain).item()
