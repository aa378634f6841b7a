"""Fused RMSNorm / RoPE modules and `fuse_cpu_ops`, which swaps them into a model in place.

`fuse_cpu_ops(model)` swaps the RMSNorm and plain RoPE modules of a module
tree for their fused subclasses, which compute the same results with the
single-node ops of `mtplx_ext.ops.fused`. The modules call the extension
directly: these calls run once per layer per decode step, and the C++ ops
check every argument again (ValueError naming it).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtplx_ext import _ext
from mtplx_ext.models.base import ZeroCentredRMSNorm
from mtplx_ext.models.module_swap import swap_modules


class FusedRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` computed by the fused `rms_norm`."""

    def __call__(self, x: mx.array) -> mx.array:
        return _ext.rms_norm(x, self["weight"], self.eps)


class FusedZeroCentredRMSNorm(ZeroCentredRMSNorm):
    """`ZeroCentredRMSNorm` (scale 1 + w) computed by the fused `rms_norm`."""

    def __call__(self, x: mx.array) -> mx.array:
        return _ext.rms_norm(x, 1.0 + self.weight, self.eps)


class FusedRoPE(nn.RoPE):
    """`nn.RoPE` computed by the fused `rope`."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return _ext.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
        )


#: Exact module types `fuse_cpu_ops` replaces, and their fused subclasses.
#: Subclasses of these (e.g. other RoPE variants) may compute something else
#: and are left alone.
_FUSED_TYPES: dict[type, type] = {
    nn.RMSNorm: FusedRMSNorm,
    ZeroCentredRMSNorm: FusedZeroCentredRMSNorm,
    nn.RoPE: FusedRoPE,
}


def _fused_copy(module: nn.Module, cls: type) -> nn.Module:
    """A `cls` holding exactly `module`'s state (parameters, frozen set,
    training flag and plain attributes): an nn.Module keeps arrays and child
    modules as dict items and everything else in its __dict__."""
    new = cls.__new__(cls)
    dict.update(new, module)
    new.__dict__.update(module.__dict__)
    return new


def fuse_cpu_ops(model: nn.Module) -> int:
    """Replaces, in place, the RMSNorm and plain RoPE modules of a module tree.

    Every `nn.RMSNorm`, `ZeroCentredRMSNorm` and `nn.RoPE` (exact types) below
    `model` becomes its fused subclass with the same weights and settings; a
    module referenced twice becomes one fused module referenced twice. Results
    equal the unfused modules' within float rounding, on any device.
    Attention is not touched: see `patch_mlx_lm_attention`.

    Args:
        model: the root module (itself never replaced).

    Returns:
        How many modules were replaced.

    Raises:
        TypeError: model is not an nn.Module.
    """

    def replacement(value: Any) -> nn.Module | None:
        cls = _FUSED_TYPES.get(type(value))
        return None if cls is None else _fused_copy(value, cls)

    return swap_modules(model, replacement)


__all__ = ["FusedRMSNorm", "FusedRoPE", "FusedZeroCentredRMSNorm", "fuse_cpu_ops"]
