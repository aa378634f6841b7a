"""`PackedLinear` and `pack_cpu_linears` / `unpack_cpu_linears`, which swap it in and out of a model.

A decoding model on MLX's CPU backend spends its step in the Linear layers'
products of a few rows by each weight (`mtplx_ext.ops.linear` says why the
packed layout is faster there). `pack_cpu_linears` replaces every float32
`nn.Linear` of a module tree by a `PackedLinear` holding the weight packed
once, in place of the row-major copy (no extra memory). The packed weight is
the module's parameter `weight_packed`; `weight` stays readable (unpacked
lazily, bit for bit). `unpack_cpu_linears` restores plain `nn.Linear`s, which
saving a model and training need: a packed model is for decoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear

from mtplx_ext import _ext
from mtplx_ext.models.module_swap import swap_modules
from mtplx_ext.models.packed_quantized import pack_cpu_quantized, unpack_cpu_quantized
from mtplx_ext.ops import linear as linear_ops


#: mlx's tensor-parallel Linear layers and how the packed form runs them: an
#: all-to-sharded layer's product is local, a sharded-to-all layer's partial
#: products are summed over the group before the bias (as mlx's own layers do).
_SHARDED = {AllToShardedLinear: "all_to_sharded", ShardedToAllLinear: "sharded_to_all"}


class PackedLinear(nn.Module):
    """An `nn.Linear` whose float32 weight is stored packed for the CPU decode GEMM.

    On a CPU default device the product is `packed_linear`; on a GPU it is
    `x @ weight.T` over the weight unpacked per call (correct, not fast: pack
    only models that decode on the CPU). With `sharded` it stands for one of
    mlx's tensor-parallel layers (its shard of the weight, its `group`); it is
    for inference only, like every packed layer.
    """

    def __init__(
        self, weight: mx.array, bias: mx.array | None = None, sharded: str | None = None, group: Any = None
    ):
        super().__init__()
        if sharded not in (None, *_SHARDED.values()):
            raise ValueError(f"sharded must be None or one of {sorted(_SHARDED.values())}, got {sharded!r}")
        object.__setattr__(self, "sharded", sharded)
        object.__setattr__(self, "group", group)
        if weight.ndim != 2 or weight.dtype != mx.float32:
            raise ValueError(f"weight must be a 2-D float32 array, got {weight.dtype} {tuple(weight.shape)}")
        self.weight_packed = linear_ops.pack_linear_weight(weight)
        if bias is not None:
            self.bias = bias
        object.__setattr__(self, "output_dims", int(weight.shape[0]))
        object.__setattr__(self, "input_dims", int(weight.shape[1]))

    @classmethod
    def from_linear(cls, linear: nn.Module) -> PackedLinear:
        """The packed form of an `nn.Linear` or of one of mlx's tensor-parallel Linear layers."""
        sharded = _SHARDED.get(type(linear))
        new = cls(linear.weight, linear.get("bias"), sharded, getattr(linear, "group", None))
        mx.eval(new.parameters())  # the row-major weight is no longer referenced
        if "weight" not in linear.trainable_parameters():
            new.freeze()
        return new

    @property
    def weight(self) -> mx.array:
        """The row-major weight [output_dims, input_dims], unpacked lazily."""
        return linear_ops.unpack_linear_weight(self.weight_packed, self.output_dims)

    def to_linear(self) -> nn.Module:
        """The unpacked layer: an `nn.Linear` (or the tensor-parallel layer it came from) with this weight and bias."""
        if self.sharded is None:
            lin = nn.Linear(self.input_dims, self.output_dims, bias="bias" in self)
        else:
            cls = next(c for c, mode in _SHARDED.items() if mode == self.sharded)
            lin = cls.__new__(cls)
            nn.Module.__init__(lin)
            lin.group = self.group
        lin.weight = self.weight
        if "bias" in self:
            lin.bias = self.bias
        mx.eval(lin.parameters())
        if "weight_packed" not in self.trainable_parameters():
            lin.freeze()
        return lin

    def __call__(self, x: mx.array) -> mx.array:
        if mx.default_device() == mx.cpu and mx.issubdtype(x.dtype, mx.floating):
            # float16 / bfloat16 inputs promote to float32, as x @ W.T would. The
            # extension directly (it checks every argument again): this runs once
            # per Linear per decode step.
            y = _ext.packed_linear(x.astype(mx.float32), self.weight_packed, self.output_dims)
        else:
            y = x @ self.weight.T
        if self.sharded == "sharded_to_all":
            y = mx.distributed.all_sum(y, group=self.group)
        return y + self.bias if "bias" in self else y

    def _extra_repr(self) -> str:
        how = f"packed, {self.sharded}" if self.sharded else "packed"
        return f"input_dims={self.input_dims}, output_dims={self.output_dims}, bias={'bias' in self}, {how}"


def packing_available() -> bool:
    """Whether this CPU runs the packed GEMM with vector FMAs (AVX2 / AVX-512 / NEON)."""
    return linear_ops.packed_linear_isa() != "generic"


def pack_cpu_linears(model: nn.Module) -> int:
    """Replaces, in place, every float32 `nn.Linear` below `model` by a `PackedLinear`.

    Exact types only: `nn.Linear` and mlx's tensor-parallel
    `AllToShardedLinear` / `ShardedToAllLinear` (their shards packed, the
    sum over the group kept); quantized and half-precision layers are left
    alone. Decoded tokens are those of the unpacked model up to float32
    rounding (the products sum in another order).

    Returns:
        How many modules were replaced.

    Raises:
        TypeError: model is not an nn.Module.
    """

    def replacement(value: Any) -> nn.Module | None:
        kind = type(value)
        if (kind is nn.Linear or kind in _SHARDED) and value.weight.dtype == mx.float32 and value.weight.ndim == 2:
            return PackedLinear.from_linear(value)
        return None

    return swap_modules(model, replacement)


def unpack_cpu_linears(model: nn.Module) -> int:
    """The inverse of `pack_cpu_linears`: every `PackedLinear` back to an `nn.Linear`, bit for bit."""
    return swap_modules(model, lambda v: v.to_linear() if isinstance(v, PackedLinear) else None)


@contextmanager
def linears_unpacked(model: nn.Module) -> Iterator[int]:
    """Within the block the model's packed layers are mlx's (saving, converting); packed again after.

    Covers `PackedLinear` (back to `nn.Linear`) and the packed quantized
    layers (back to mlx's quantized ones).
    """
    n = unpack_cpu_linears(model)
    nq = unpack_cpu_quantized(model)
    try:
        yield n + nq
    finally:
        if n:
            pack_cpu_linears(model)
        if nq:
            pack_cpu_quantized(model)


__all__ = ["PackedLinear", "linears_unpacked", "pack_cpu_linears", "packing_available", "unpack_cpu_linears"]
