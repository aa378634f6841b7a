"""Routing of mlx-lm's attention helper and SwiGLU through the fused CPU ops.

`patch_mlx_lm_attention()` / `patch_mlx_lm_swiglu()` (both:
`patch_mlx_lm_ops()`) route mlx-lm's module-level functions through
`mtplx_ext.ops.fused` until their handle's `undo()`. mlx-lm's model modules
call `scaled_dot_product_attention` and `swiglu` by module-level names
imported from `mlx_lm.models.base` / `.activations`, so there is no per-model
hook: a patch replaces the name in the defining module and in every
`mlx_lm.models.*` module that imported it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable

import mlx.core as mx

from mtplx_ext import _ext

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
        models = _mlx_lm_model_modules() if self._routes else []
        for func, original, router, mods in self._routes:
            for mod in [*mods, *models]:
                if getattr(mod, func, None) is router:
                    setattr(mod, func, original)
        self._routes = []

    def __enter__(self) -> "MlxLmPatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


#: The handle type of `patch_mlx_lm_attention` (kept under its first name).
AttentionPatch = MlxLmPatch


def _mlx_lm_model_modules() -> list[ModuleType]:
    """The `mlx_lm.models.*` modules imported so far.

    The import system binds each imported submodule as an attribute of its
    package, so the package's namespace lists them: a pass over it, not over
    `sys.modules` (thousands of entries in a process that imported
    transformers; each decode session patches and undoes).
    """
    pkg = sys.modules.get("mlx_lm.models")
    if pkg is None:
        return []
    return [m for m in list(vars(pkg).values())
            if isinstance(m, ModuleType) and m.__name__.startswith("mlx_lm.models.")]


def _route(where: tuple[str, str], make_router: Callable[[Callable], Callable]) -> tuple:
    """Puts a router in place of mlx-lm's function `where` = (module, name).

    Returns:
        (name, original, router, modules patched); no modules when a router
        is already in place.
    """
    base_name, func = where
    base = importlib.import_module(base_name)
    original = getattr(base, func)
    if getattr(original, "mtplx_router", False):
        return (func, original, original, [])
    router = make_router(original)
    router.mtplx_router = True  # type: ignore[attr-defined]
    modules = []
    for mod in [base, *_mlx_lm_model_modules()]:
        if mod not in modules and getattr(mod, func, None) is original:
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
        if sinks is not None:
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        if hasattr(cache, "bits"):  # quantized KV: (packed, scales, biases) keys and values
            return _ext.quantized_scaled_dot_product_attention(
                queries, tuple(keys), tuple(values), scale=scale, bits=cache.bits,
                group_size=cache.group_size, mask=mask,
            )
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
    imported later pick it up from base), by a router: attention sinks go to
    mlx-lm's own helper, quantized KV caches (those with `bits`) to
    `quantized_scaled_dot_product_attention`, everything else to
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
