"""Quantized layers repacked for the CPU's integer dot products, and the swap in and out of a model.

`pack_cpu_quantized` replaces every affine-quantized `nn.QuantizedLinear`
and `nn.QuantizedEmbedding` below a module (trunk, LM head tied or not, MTP
head) by `PackedQuantizedLinear` / `PackedQuantizedEmbedding`, which hold the
weight repacked once (`mtplx_ext.ops.qlinear`, in place of mlx's copy: no
extra memory) and multiply on the CPU with the extension's quantized GEMM.
`unpack_cpu_quantized` restores mlx's layers bit for bit (saving writes
mlx's format). Sibling projections of one input (q / k / v, gate / up) are
then fused into one product (`SharedProduct`): one kernel call, one
quantization of the activations and one thread split instead of three,
their weights one concatenated array that each layer views its panels of. On a GPU the packed layers fall back to mlx's own kernels over
the weight unpacked per call: pack only models that decode on the CPU.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from mtplx_ext import _ext
from mtplx_ext.models.module_swap import swap_modules
from mtplx_ext.ops import qlinear


class _Packed(nn.Module):
    """The repacked weight (`wq`, `sb`) of an affine-quantized [output_dims, input_dims] matrix."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.wq, self.sb = qlinear.pack_quantized_weight(
            layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits
        )
        object.__setattr__(self, "output_dims", int(layer["weight"].shape[0]))
        object.__setattr__(self, "input_dims", int(layer["weight"].shape[1]) * 32 // layer.bits)
        object.__setattr__(self, "group_size", int(layer.group_size))
        object.__setattr__(self, "bits", int(layer.bits))

    def _product(self, x: mx.array) -> mx.array:
        if mx.default_device() == mx.cpu and mx.issubdtype(x.dtype, mx.floating):
            shared = self.__dict__.get("_shared")
            if shared is not None:
                return shared.columns(x, self)
            if _ORDER is not None:
                _ORDER.append(self)
            # The extension directly (it checks every argument): once per layer per step.
            return _ext.packed_quantized_linear(
                x, self.wq, self.sb, self.output_dims, self.group_size, self.bits,
                prefetch=self.__dict__.get("_prefetch", ()),
            )
        w, s, b = self.mlx_weights()
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=self.group_size, bits=self.bits)

    def mlx_weights(self) -> tuple[mx.array, mx.array, mx.array]:
        """(weight, scales, biases) in mlx's format, bit for bit those packed."""
        return qlinear.unpack_quantized_weight(self.wq, self.sb, self.output_dims, self.group_size, self.bits)

    def _restore(self, layer: nn.Module) -> nn.Module:
        layer.weight, layer.scales, layer.biases = self.mlx_weights()
        mx.eval(layer.parameters())
        layer.freeze()
        return layer

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"group_size={self.group_size}, bits={self.bits}, packed"
        )


#: While `product_order` runs: the packed products in the order computed.
_ORDER: list | None = None


def product_order(run: Callable[[], Any]) -> list:
    """The packed products (layers and shared products) that `run()` computes, in order."""
    global _ORDER
    _ORDER = []
    try:
        run()
        return _ORDER
    finally:
        _ORDER = None


def link_prefetch(order: list) -> int:
    """Makes each product of `order` hand the next one's weight to the CPU's idle worker (the last the first's).

    A product then returns with the thread pool's idle worker streaming the
    next product's packed weight toward the caches while the ops between the
    two run (`packed_quantized_linear(..., prefetch=)`): results unchanged,
    memory traffic moved into time the weights' stream would otherwise sit
    idle. A product computed twice in `order` (a tied LM head that trunk
    and head both use) links to what follows its last use. Returns how many
    links were made.
    """
    links = 0
    for a, b in zip(order, order[1:] + order[:1]):
        if a is b:
            continue
        pair = (b.wq, b.sb)
        if isinstance(a, SharedProduct):
            a.prefetch = pair
        else:
            object.__setattr__(a, "_prefetch", pair)
        links += 1
    return links


class PackedQuantizedLinear(_Packed):
    """An `nn.QuantizedLinear` (affine) whose weight is repacked for the CPU's quantized GEMM."""

    def __init__(self, layer: nn.QuantizedLinear):
        super().__init__(layer)
        if "bias" in layer:
            self.bias = layer["bias"]

    def __call__(self, x: mx.array) -> mx.array:
        y = self._product(x)
        return y + self.bias if "bias" in self else y

    def to_quantized(self) -> nn.QuantizedLinear:
        """mlx's layer with this weight, bit for bit."""
        lin = nn.QuantizedLinear(self.input_dims, self.output_dims, "bias" in self, self.group_size, self.bits)
        if "bias" in self:
            lin.bias = self.bias
        return self._restore(lin)


class PackedQuantizedEmbedding(_Packed):
    """An `nn.QuantizedEmbedding` (affine) repacked: lookups gather and dequantize rows, `as_linear` is the GEMM.

    A lookup dequantizes only the looked-up rows, bit for bit as
    `mx.dequantize` does, so embeddings are mlx-lm's.
    """

    def __call__(self, ids: mx.array) -> mx.array:
        if mx.default_device() == mx.cpu:  # one node (mlx's dequantize is ~50 on the CPU)
            return qlinear.packed_quantized_embedding(self.wq, self.sb, ids, self.output_dims, self.group_size, self.bits)
        w, s, b = qlinear.unpack_quantized_rows(self.wq, self.sb, ids, self.group_size, self.bits)
        return mx.dequantize(w, s, b, group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._product(x)

    def to_quantized(self) -> nn.QuantizedEmbedding:
        """mlx's layer with this weight, bit for bit."""
        emb = nn.QuantizedEmbedding(self.output_dims, self.input_dims, self.group_size, self.bits)
        return self._restore(emb)


class SharedProduct:
    """One quantized product for sibling layers of one input (q / k / v, gate / up).

    The members' packed weights are concatenated panel-wise (every member
    but the last has a whole number of 64-column panels) and each member
    keeps a view of its own panels, so memory is unchanged and each member
    still multiplies alone on a GPU or when unpacked. On the CPU the first
    member called with an input computes the whole product; the others,
    called with the same array (as mlx-lm's attention and MLP do), take
    their columns of it. The product is released once every member has had
    its columns, and recomputed for any other input, so a member called
    alone or out of order still gets its own exact columns (the kernel's
    columns do not depend on each other).
    """

    def __init__(self, members: list[_Packed]):
        first = members[0]
        self.wq = mx.concatenate([m.wq for m in members])
        self.sb = mx.concatenate([m.sb for m in members])
        mx.eval(self.wq, self.sb)
        self.n = sum(m.output_dims for m in members)
        self.group_size, self.bits = first.group_size, first.bits
        self.spans: dict[int, tuple[int, int]] = {}
        p0 = c0 = 0
        for m in members:
            p = m.wq.shape[0]
            m.wq, m.sb = self.wq[p0 : p0 + p], self.sb[p0 : p0 + p]  # views of the shared panels
            self.spans[id(m)] = (c0, c0 + m.output_dims)
            object.__setattr__(m, "_shared", self)
            p0, c0 = p0 + p, c0 + p * qlinear.PANEL
        mx.eval([(m.wq, m.sb) for m in members])
        self._x: mx.array | None = None
        self._y: mx.array | None = None
        self.prefetch: tuple[mx.array, ...] = ()  # `link_prefetch`
        self._served: set[int] = set()

    def columns(self, x: mx.array, member: _Packed) -> mx.array:
        if self._x is not x or id(member) in self._served:
            self._x, self._served = x, set()
            if _ORDER is not None:
                _ORDER.append(self)
            self._y = _ext.packed_quantized_linear(
                x, self.wq, self.sb, self.n, self.group_size, self.bits, prefetch=self.prefetch
            )
        c0, c1 = self.spans[id(member)]
        out = self._y[..., c0:c1]
        self._served.add(id(member))
        if len(self._served) == len(self.spans):
            self._x = self._y = None
        return out


#: Sibling layers that read one input, fused into one product.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fuse_siblings(model: nn.Module) -> int:
    """Shares one product between the packed sibling layers of every module (`FUSED_GROUPS`).

    Members must agree on input size, group size, bits and scale dtype, and
    every member but the last must fill whole panels. Returns how many
    groups were fused.
    """
    fused = 0
    for _, parent in model.named_modules():
        for names in FUSED_GROUPS:
            ms = [parent.get(n) for n in names if n in parent]
            if len(ms) < 2 or not all(type(m) is PackedQuantizedLinear and "_shared" not in m.__dict__ for m in ms):
                continue
            key = {(m.input_dims, m.group_size, m.bits, m.sb.dtype) for m in ms}
            if len(key) == 1 and all(m.output_dims % qlinear.PANEL == 0 for m in ms[:-1]):
                SharedProduct(ms)
                fused += 1
    return fused


def _packable(value: Any) -> bool:
    return (
        type(value) in (nn.QuantizedLinear, nn.QuantizedEmbedding)
        and getattr(value, "mode", "affine") == "affine"
        and "biases" in value
        and value.bits in qlinear.BITS
        and value.group_size in qlinear.GROUP_SIZES
        and value["scales"].dtype in qlinear.SCALE_DTYPES
    )


def pack_cpu_quantized(model: nn.Module) -> int:
    """Replaces, in place, every affine `nn.QuantizedLinear` / `nn.QuantizedEmbedding` below `model` by its packed form.

    Exact types only, mode "affine" with biases, bits 2-6 / 8, group size
    32 / 64 / 128; other quantizations (mxfp4, nvfp4, ...) stay mlx's.
    Outputs match mlx's quantized matmul up to the int8 rounding of the
    activations (`mtplx_ext.ops.qlinear`); a row's result never depends on
    the other rows. Returns how many modules were replaced.
    """

    def replacement(value: Any) -> nn.Module | None:
        if not _packable(value):
            return None
        new = (PackedQuantizedEmbedding if type(value) is nn.QuantizedEmbedding else PackedQuantizedLinear)(value)
        mx.eval(new.parameters())  # mlx's copy is no longer referenced
        new.freeze()
        return new

    n = swap_modules(model, replacement)
    fuse_siblings(model)
    return n


def unpack_cpu_quantized(model: nn.Module) -> int:
    """The inverse of `pack_cpu_quantized`: mlx's quantized layers back, bit for bit."""
    return swap_modules(model, lambda v: v.to_quantized() if isinstance(v, _Packed) else None)


__all__ = [
    "link_prefetch",
    "product_order",
    "PackedQuantizedEmbedding",
    "PackedQuantizedLinear",
    "SharedProduct",
    "fuse_siblings",
    "pack_cpu_quantized",
    "unpack_cpu_quantized",
]
