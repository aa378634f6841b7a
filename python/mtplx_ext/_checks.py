"""Argument checks shared by the wrappers: errors name the argument."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mtplx_ext import _ext

LOGIT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

#: Most drafts of one cycle (depth K): the kernels' chain buffers hold this
#: many (kMaxChainDrafts in metal/mtplx_rules.h, exported by the extension).
MAX_DRAFTS: int = _ext.MAX_CHAIN_DRAFTS


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


def require_chain_logits(name: str, value: object, max_drafts: int) -> tuple[mx.array, int]:
    """Checks [B, K + 1, V] logits of a depth-K chain; returns them and K."""
    a = require_logits(name, value, 3)
    K = a.shape[1] - 1
    if not 1 <= K <= max_drafts:
        raise ValueError(
            f"{name} must have shape [B, K + 1, V] with K in [1, {max_drafts}], got {tuple(a.shape)}"
        )
    return a, K


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


def require_token_batch(name: str, value: object) -> mx.array:
    """Checks a non-empty [B, T] integer token array."""
    a = require_array(name, value)
    if a.ndim != 2:
        raise ValueError(f"{name} must have shape [B, T], got {tuple(a.shape)}")
    if not mx.issubdtype(a.dtype, mx.integer):
        raise TypeError(f"{name} must have an integer dtype, got {a.dtype}")
    if a.size == 0:
        raise ValueError(f"{name} is empty: shape {tuple(a.shape)}")
    return a


def as_prompts(prompts: object, vocab_size: int) -> list[list[int]]:
    """Token-id lists, each non-empty and inside the vocabulary (TypeError / ValueError)."""
    if isinstance(prompts, (str, bytes, mx.array)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, np.ndarray) and p.ndim == 1:
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TypeError(f"prompts[{i}] must be a list of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty")
        for j, t in enumerate(p):
            if not is_int(t):
                raise TypeError(f"prompts[{i}][{j}] must be an int token id, got {type(t).__name__}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompts[{i}][{j}] = {t} is outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in p])
    return out


def as_stop_ids(stop_token_ids: object, vocab_size: int) -> frozenset[int]:
    """A set of stop token ids inside the vocabulary (TypeError / ValueError)."""
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise TypeError("stop_token_ids must be a collection of int token ids")
    ids = list(stop_token_ids)
    for t in ids:
        if not is_int(t):
            raise TypeError(f"stop_token_ids must hold int token ids, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
    return frozenset(int(t) for t in ids)


#: Seeds are 64-bit words (two uint32 key words on the device).
SEED_LIMIT = 2**64


def is_int(value: object) -> bool:
    """True for a Python or NumPy integer (bools are not counted as ints)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as a Python int, checked against [lo, hi).

    Accepts Python and NumPy integers alike (a NumPy scalar handed on would
    break MLX calls further down, e.g. inside a compiled step), so call this
    where an argument enters the public API.

    Raises:
        TypeError: not an integer (floats, bools and strings included), naming `name`.
        ValueError: outside [lo, hi), naming `name`.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v >= hi):
        if hi is None:
            want = f">= {lo}"
        elif lo is None:
            want = f"< {hi}"
        else:
            want = f"in [{lo}, {_pow2(hi)})"
        raise ValueError(f"{name} must be an int {want}, got {v}")
    return v


def as_int_list(name: str, values: object, lo: int | None = None, hi: int | None = None) -> list[int]:
    """A sequence (list, tuple, 1-D NumPy array) of ints as a list, each checked by `as_int`.

    Raises:
        TypeError: not such a sequence, or an entry that is no integer (named `name[i]`).
        ValueError: an entry outside [lo, hi).
    """
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = list(values)
    if isinstance(values, (str, bytes, mx.array)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__}")
    return [as_int(f"{name}[{i}]", v, lo, hi) for i, v in enumerate(values)]


def as_seed(name: str, value: object) -> int | None:
    """A seed: None, or an int in [0, 2**64) (see `as_int`)."""
    return None if value is None else as_int(name, value, 0, SEED_LIMIT)


def as_seeds(name: str, values: object) -> list[int] | None:
    """Per-stream seeds: None, or a sequence of ints in [0, 2**64) (see `as_int_list`)."""
    return None if values is None else as_int_list(name, values, 0, SEED_LIMIT)


def _pow2(n: int) -> str:
    # 2**64 reads better than 18446744073709551616 in a one-line error.
    return f"2**{n.bit_length() - 1}" if n > 1024 and n & (n - 1) == 0 else str(n)


def as_depth(depth: object) -> int:
    """Drafts per cycle: an int in [1, MAX_DRAFTS] (TypeError / ValueError naming `depth`)."""
    return as_int("depth", depth, lo=1, hi=MAX_DRAFTS + 1)


def require_logit_bias(value: object, batch: int) -> tuple[mx.array, mx.array] | None:
    """Checks a padded per-row logit bias: None, or (ids [B, M] integer, values [B, M] floating), M >= 1.

    Entry (b, e) adds values[b, e] to the logit of ids[b, e] in row b; an id
    outside [0, V) adds nothing (-1 pads a row). The kernels check the same;
    this names the argument before any graph is built.
    """
    if value is None:
        return None
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(
            f"logit_bias must be None or a pair (ids, values) of [B, M] arrays, got {type(value).__name__}"
        )
    ids = require_array("logit_bias ids", value[0])
    values = require_array("logit_bias values", value[1])
    if ids.ndim != 2 or ids.shape[0] != batch or ids.shape[1] < 1:
        raise ValueError(f"logit_bias ids must have shape [B, M] with B = {batch} and M >= 1, got {tuple(ids.shape)}")
    require_kind("logit_bias ids", ids, tuple(ids.shape), mx.integer, "an integer")
    require_kind("logit_bias values", values, tuple(ids.shape), mx.floating, "a floating")
    return ids, values
