"""Argument checks shared by the wrappers: errors name the argument."""

from __future__ import annotations

import mlx.core as mx

LOGIT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


class CheckpointError(ValueError):
    """A model folder, config or tensor that cannot be loaded (one-line message)."""


def require_array(name: str, value: object) -> mx.array:
    """Returns `value` if it is an mx.array, else raises TypeError naming it."""
    if not isinstance(value, mx.array):
        raise TypeError(f"{name} must be an mx.array, got {type(value).__name__}")
    return value


def require_logits(name: str, value: object, ndim: int) -> mx.array:
    """Checks a floating logits array of the given rank."""
    a = require_array(name, value)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(a.shape)}")
    if a.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {a.dtype}")
    if a.shape[-1] < 1:
        raise ValueError(f"{name} has an empty vocabulary axis: shape {tuple(a.shape)}")
    return a


def require_kind(
    name: str, value: object, shape: tuple[int, ...], kind: mx.DtypeCategory, what: str
) -> mx.array:
    """Checks an array of exactly `shape` whose dtype is of `kind` (e.g. mx.integer)."""
    a = require_array(name, value)
    if not mx.issubdtype(a.dtype, kind):
        raise TypeError(f"{name} must have {what} dtype, got {a.dtype}")
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")
    return a


def require_int_tokens(name: str, value: object, shape: tuple[int, ...]) -> mx.array:
    """Checks an integer token array of exactly `shape`."""
    return require_kind(name, value, shape, mx.integer, "an integer")
