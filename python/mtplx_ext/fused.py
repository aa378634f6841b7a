"""Single-node CPU forms of MLX's fast RMSNorm, RoPE and attention ops and of
mlx-lm's SwiGLU.

On MLX's CPU backend `mx.fast.rms_norm`, `mx.fast.rope` and
`mx.fast.scaled_dot_product_attention` expand into their composed fallback
graphs (about 8, 20 and 15 nodes each). In a small decode forward most of the
time then goes to per-node scheduling rather than math. mlx-lm's compiled
`swiglu` becomes one node, but a scalar loop calling libm per element (a
fifth of a batch-8 verification forward of the shipped model). The ops here
compute the same results in one vectorised graph node each on a CPU stream;
on a GPU stream they call `mx.fast` (or, for swiglu, the composed ops) itself,
whose Metal kernels are already fused. Gradients go
through `mx.fast`'s differentiable fallback, so training through fused modules
works.

Opting in:

* `fuse_cpu_ops(model)` swaps the RMSNorm and plain RoPE modules of a module
  tree for their fused subclasses, in place.
* `patch_mlx_lm_attention()` / `patch_mlx_lm_swiglu()` (both:
  `patch_mlx_lm_ops()`) route mlx-lm's attention helper / SwiGLU through the
  fused ops until their handle's `undo()` (mlx-lm model modules call
  module-level functions, so there is no per-model hook).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mtplx_ext import _ext
from mtplx_ext._checks import LOGIT_DTYPES, as_int, is_int, require_array
from mtplx_ext.models.base import ZeroCentredRMSNorm

StreamLike = mx.Stream | mx.Device | None

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _require_float(name: str, value: object) -> mx.array:
    a = require_array(name, value)
    if a.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {a.dtype}")
    return a


def _require_number(name: str, value: object) -> float:
    # NumPy scalars too (np.float32 is no Python float); bools are no numbers.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def rms_norm(
    x: mx.array,
    weight: mx.array | None,
    eps: float,
    *,
    stream: StreamLike = None,
) -> mx.array:
    """Root-mean-square normalisation of the last axis, as `mx.fast.rms_norm`.

    Computes `x / sqrt(mean(x**2) + eps)` with the mean in float32, casts it
    to the output dtype and multiplies by `weight` in that dtype (the rounding
    steps of `mx.fast.rms_norm`).

    Args:
        x: [..., D] float32/float16/bfloat16 array (any strides).
        weight: [D] float array, or None for no scale.
        eps: small constant added to the mean square, >= 0.
        stream: MLX stream or device (default: the default stream).

    Returns:
        Array of x's shape, row contiguous; dtype of x (promoted with weight's).

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: weight's shape does not match x's last axis, or eps < 0.
    """
    x = _require_float("x", x)
    if weight is not None:
        weight = _require_float("weight", weight)
    eps = _require_number("eps", eps)
    return _ext.rms_norm(x, weight, eps, stream=stream)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float,
    scale: float,
    offset: int | mx.array,
    stream: StreamLike = None,
) -> mx.array:
    """Rotary positional embedding, as `mx.fast.rope` with a scalar base.

    Feature pairs of the first `dims` features are rotated by
    theta_i = (offset + t) * scale * base**(-i / (dims / 2)) at sequence
    position t (axis -2); the other features pass through.

    Args:
        x: [B, ..., T, D] float32/float16/bfloat16 array (e.g. mlx-lm's
            [B, n_heads, L, head_dim]), any strides.
        dims: number of leading features to rotate; even, <= D.
        traditional: rotate consecutive pairs (2i, 2i + 1) instead of
            (i, i + dims / 2).
        base: frequency base, > 0.
        scale: factor on the positions.
        offset: position of x's first row: an int, or an integer mx.array of
            size 1 or B (one per batch entry, as mlx-lm's BatchKVCache).
        stream: MLX stream or device (default: the default stream).

    Returns:
        Array of x's shape and dtype, row contiguous.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: bad shapes, dims or base.
    """
    x = _require_float("x", x)
    dims = as_int("dims", dims)
    if not isinstance(traditional, bool):
        raise TypeError(f"traditional must be a bool, got {type(traditional).__name__}")
    base = _require_number("base", base)
    scale = _require_number("scale", scale)
    if isinstance(offset, mx.array):
        if not mx.issubdtype(offset.dtype, mx.integer):
            raise TypeError(f"offset must have an integer dtype, got {offset.dtype}")
    elif not is_int(offset):
        raise TypeError(f"offset must be an int or an mx.array, got {type(offset).__name__}")
    elif not _INT32_MIN <= offset <= _INT32_MAX:
        raise ValueError(f"offset must fit in int32, got {offset}")
    else:
        offset = int(offset)
    return _ext.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset, stream=stream
    )


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
    stream: StreamLike = None,
) -> mx.array:
    """softmax(scale * q @ k.T + mask) @ v per head, as the `mx.fast` op.

    Grouped-query attention: query head h reads kv head h // (Hq // Hkv).
    The softmax runs in float32 with the row maximum subtracted. As in
    `mx.fast`: a row whose keys are all masked by a bool or causal mask
    averages the values uniformly; a row whose scores are all -inf under an
    additive mask (or hold NaN) comes out NaN.

    Args:
        queries: [B, Hq, T, D] float32/float16/bfloat16 array (any strides).
        keys: [B, Hkv, S, D], Hq a multiple of Hkv.
        values: [B, Hkv, S, Dv].
        scale: factor on the scores, usually D ** -0.5.
        mask: None; "causal" (query t sees keys s <= t + S - T); a bool array
            broadcastable to [B, Hq, T, S] (True = attend); or an additive
            array of a dtype that promotes to the attention dtype.
        stream: MLX stream or device (default: the default stream).

    Returns:
        [B, Hq, T, Dv] array of the promoted q/k/v dtype, row contiguous.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: shapes do not fit together, or a bad mask.
    """
    queries = _require_float("queries", queries)
    keys = _require_float("keys", keys)
    values = _require_float("values", values)
    scale = _require_number("scale", scale)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f'mask must be None, "causal" or an mx.array, got {mask!r}')
    elif mask is not None and not isinstance(mask, mx.array):
        raise TypeError(f'mask must be None, "causal" or an mx.array, got {type(mask).__name__}')
    return _ext.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, stream=stream
    )


def swiglu(gate: mx.array, x: mx.array, *, stream: StreamLike = None) -> mx.array:
    """silu(gate) * x, as mlx-lm's `swiglu` (the SwiGLU MLPs' activation).

    Computes gate * sigmoid(gate) * x in float32, rounding to the output
    dtype after each of the three ops as the composed graph does.

    Args:
        gate: float32/float16/bfloat16 array (any strides), at least 1-D.
        x: array of gate's shape.
        stream: MLX stream or device (default: the default stream).

    Returns:
        Array of their shape and promoted dtype, row contiguous.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: the shapes differ, or gate is a scalar.
    """
    gate = _require_float("gate", gate)
    x = _require_float("x", x)
    return _ext.swiglu(gate, x, stream=stream)


# ---------------------------------------------------------------------------
# Modules
#
# They call the extension directly: these calls run once per layer per decode
# step, and the C++ ops check every argument again (ValueError naming it).


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
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    swapped: dict[int, nn.Module] = {}
    visited: set[int] = set()

    def replacement(value: Any) -> Any:
        cls = _FUSED_TYPES.get(type(value))
        if cls is None:
            return None
        if id(value) not in swapped:
            swapped[id(value)] = _fused_copy(value, cls)
        return swapped[id(value)]

    def walk(node: Any) -> None:
        if id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, (dict, list)):  # nn.Module is a dict
            keys = list(node.keys()) if isinstance(node, dict) else range(len(node))
            for key in keys:
                child = node[key]
                new = replacement(child)
                if new is not None:
                    node[key] = new
                elif isinstance(child, tuple):
                    items = [c if (r := replacement(c)) is None else r for c in child]
                    if any(a is not b for a, b in zip(items, child)):
                        node[key] = tuple(items)
                    for c in node[key]:
                        walk(c)
                else:
                    walk(child)

    walk(model)
    return len(swapped)


# ---------------------------------------------------------------------------
# mlx-lm routing
#
# mlx-lm's model modules call `scaled_dot_product_attention` and `swiglu` by
# module-level names imported from `mlx_lm.models.base` / `.activations`, so
# there is no per-model hook: a patch replaces the name in the defining module
# and in every `mlx_lm.models.*` module that imported it.

_ATTENTION = ("mlx_lm.models.base", "scaled_dot_product_attention")
_SWIGLU = ("mlx_lm.models.activations", "swiglu")


class MlxLmPatch:
    """Undo handle of the `patch_mlx_lm_*` routings; also a context manager."""

    def __init__(self, routes: list[tuple[str, Callable, Callable, list[ModuleType]]]):
        # (function name, mlx-lm's original, router, modules patched)
        self._routes = [r for r in routes if r[3]]

    @property
    def active(self) -> bool:
        """True until `undo()` (False for a patch that changed nothing)."""
        return bool(self._routes)

    @property
    def module_names(self) -> list[str]:
        """Names of the modules whose helpers this patch replaced."""
        names: list[str] = []
        for _, _, _, mods in self._routes:
            names += [m.__name__ for m in mods if m.__name__ not in names]
        return names

    def undo(self) -> None:
        """Restores mlx-lm's own helpers where this patch put a router,
        including in model modules imported while it was active."""
        for func, original, router, mods in self._routes:
            targets = list(mods)
            for name, mod in list(sys.modules.items()):
                if name.startswith("mlx_lm.models.") and mod is not None and mod not in targets:
                    targets.append(mod)
            for mod in targets:
                if getattr(mod, func, None) is router:
                    setattr(mod, func, original)
        self._routes = []

    def __enter__(self) -> "MlxLmPatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


#: The handle type of `patch_mlx_lm_attention` (kept under its first name).
AttentionPatch = MlxLmPatch


def _route(where: tuple[str, str], make_router: Callable[[Callable], Callable]) -> tuple:
    """Puts a router in place of mlx-lm's function `where` = (module, name).

    Returns:
        (name, original, router, modules patched); no modules when a router
        is already in place.
    """
    base_name, func = where
    base = importlib.import_module(base_name)
    original = getattr(base, func)
    if getattr(original, "_mtplx_router", False):
        return (func, original, original, [])
    router = make_router(original)
    router._mtplx_router = True  # type: ignore[attr-defined]
    modules = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == base_name or name.startswith("mlx_lm.models.")):
            continue
        if getattr(mod, func, None) is original:
            setattr(mod, func, router)
            modules.append(mod)
    return (func, original, router, modules)


def _attention_router(original: Callable) -> Callable:
    def routed_attention(
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: mx.array | str | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if sinks is not None or hasattr(cache, "bits"):
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return _ext.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    return routed_attention


def _swiglu_router(original: Callable) -> Callable:
    def routed_swiglu(gate: mx.array, x: mx.array) -> mx.array:
        # Shapes that broadcast (never in mlx-lm's MLPs) keep mlx-lm's op.
        if gate.shape != x.shape:
            return original(gate, x)
        return _ext.swiglu(gate, x)

    return routed_swiglu


def patch_mlx_lm_attention() -> MlxLmPatch:
    """Routes mlx-lm's attention helper through the fused attention (opt in).

    Replaces `mlx_lm.models.base.scaled_dot_product_attention`, there and in
    every already imported `mlx_lm.models.*` module holding it (modules
    imported later pick it up from base), by a router: quantized KV caches
    and attention sinks go to mlx-lm's own helper, everything else to
    `scaled_dot_product_attention` here. It affects every mlx-lm model in the
    process until `undo()` on the returned handle (or the end of a `with`
    block). Calling it while a patch is active changes nothing and returns
    an inactive handle.

    Returns:
        The handle; `undo()` restores mlx-lm's helper.
    """
    return MlxLmPatch([_route(_ATTENTION, _attention_router)])


def patch_mlx_lm_swiglu() -> MlxLmPatch:
    """Routes mlx-lm's `swiglu` activation through the fused `swiglu` (opt in).

    Same mechanism and scope as `patch_mlx_lm_attention`, for
    `mlx_lm.models.activations.swiglu` (the SwiGLU of the Qwen, DeepSeek,
    GLM and MiMo MLPs and of their MoE experts). On MLX's CPU backend it
    compiles into a scalar loop; the fused op is one vectorised node.

    Returns:
        The handle; `undo()` restores mlx-lm's function.
    """
    return MlxLmPatch([_route(_SWIGLU, _swiglu_router)])


def patch_mlx_lm_ops() -> MlxLmPatch:
    """`patch_mlx_lm_attention` and `patch_mlx_lm_swiglu` under one handle."""
    return MlxLmPatch([_route(_ATTENTION, _attention_router), _route(_SWIGLU, _swiglu_router)])
