"""Gated delta rule with per-position state capture, and its routing in mlx-lm.

`gated_delta_capture` runs the gated delta rule recurrence of a [B, T] chunk
(mlx-lm's `gated_delta_update` math: scalar gate, float32 accumulation) and
also returns the recurrent state after every position, [B, T, Hv, Dv, Dk].
A decode cycle's verification forward of [x0, d_1..d_K] thus leaves every
stream's state at each accepted length n = 0..K on the device; the commit
selects row n per stream (`cache_state.commit_streams`) instead of restoring
a snapshot and re-forwarding.

`route_gated_delta()` routes the GatedDeltaNet layers of mlx-lm's
`qwen3_next` and `qwen3_5` (and `qwen3_5_moe`, which reuses them) through it
while a decode runs: inside `capture(caches)`, each layer's captured states
and its short-convolution input window ([old conv state, new inputs]) are
recorded per cache; outside it, decode-sized chunks on a CPU stream use the
fused op (faster than mlx-lm's op-by-op CPU path) and everything else goes
to mlx-lm's own `gated_delta_update`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from mtplx_ext import _ext
from mtplx_ext._checks import LOGIT_DTYPES, require_array

#: Largest key head size the kernels take (metal/gated_delta_rules.h).
MAX_KEY_DIM = 256
#: Chunks up to this length use the fused op outside a capture (decode
#: steps); longer ones (prefill) keep mlx-lm's path, which stores no states.
FUSED_MAX_T = 16

_FUNC = "gated_delta_update"


def gated_delta_capture(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> tuple[mx.array, mx.array]:
    """Gated delta rule over a chunk, returning the state after every position.

    With s = state[b, h, j, :] (float32 for the whole chunk), per position t:
    s = s * g; delta = (v[j] - s . k) * beta; s = s + k * delta;
    y[b, t, h, j] = s . q; states[b, t, h, j, :] = s. Key head hk = h // (Hv // Hk).
    q and k are taken as given (mlx-lm's `normalize_qk` folds the scale in).

    Args:
        q, k: [B, T, Hk, Dk] (float32 / float16 / bfloat16, one dtype with v;
            Dk at most 256).
        v: [B, T, Hv, Dv], Hv a multiple of Hk.
        g: [B, T, Hv] decay per position and value head (any float dtype).
        beta: [B, T, Hv] update strength (any float dtype).
        state: [B, Hv, Dv, Dk] the state before the chunk (a float dtype).
        stream: MLX stream or device.

    Returns:
        (y [B, T, Hv, Dv] in q's dtype, states [B, T, Hv, Dv, Dk] in the
        state's dtype); states[:, -1] is the state after the chunk.

    Raises:
        TypeError: an argument is not an mx.array.
        ValueError: a shape or dtype does not fit, naming the argument.
    """
    args = [require_array(n, a) for n, a in zip(("q", "k", "v", "g", "beta", "state"), (q, k, v, g, beta, state))]
    return tuple(_ext.gated_delta_capture(*args, stream=stream))  # type: ignore[return-value]


@dataclass
class LayerCapture:
    """What one GatedDeltaNet layer left during a captured forward.

    Attributes:
        conv_input: [B, W - 1 + T, C] its convolution's input (old conv
            state, then the chunk's inputs); the conv state after n + 1
            tokens is rows n + 1 .. n + W - 1.
        states: [B, T, Hv, Dv, Dk] the recurrent state after every position.
    """

    conv_input: mx.array
    states: mx.array


@dataclass
class Capture:
    """Per-cache captures of one verification forward (see `capture`)."""

    by_cache: dict[int, LayerCapture] = field(default_factory=dict)
    #: id(state array) -> id(cache), taken when the capture starts.
    state_ids: dict[int, int] = field(default_factory=dict, init=False)
    #: The conv input of the layer running now (its [old conv state, inputs]), taken by the conv recorder.
    conv: mx.array | None = field(default=None, init=False)

    def of(self, cache: Any) -> LayerCapture:
        """The capture of a recurrent cache; KeyError if its layer did not run."""
        try:
            return self.by_cache[id(cache)]
        except KeyError:
            raise KeyError(f"no gated-delta capture for cache {type(cache).__name__} at {id(cache):#x}") from None


_active: list[Capture] = []
_route_depth = 0


@contextmanager
def capture(recurrent_caches: Sequence[Any]) -> Iterator[Capture]:
    """Records every routed GatedDeltaNet layer's states during a forward.

    Needs `route_gated_delta()` active. A layer is matched to its cache by
    the state array it reads (`cache[1]`), so each cache must hold a state.

    Args:
        recurrent_caches: the trunk's `ArraysCache`s (conv state, state).

    Raises:
        RuntimeError: when the routing is not active.
    """
    if _route_depth == 0:
        raise RuntimeError("gated_delta.capture needs route_gated_delta() to be active")
    cap = Capture()
    for c in recurrent_caches:
        if c[1] is not None:
            cap.state_ids[id(c[1])] = id(c)
    _active.append(cap)
    try:
        yield cap
    finally:
        _active.remove(cap)


def _gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array, lower_bound: float | None,
           allow_neg_eigval: bool) -> tuple[mx.array, mx.array]:
    # mlx-lm's own gate functions, so the routed layer sees the same g and beta.
    from mlx_lm.models import gated_delta as gd  # noqa: PLC0415

    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    g = gd.compute_g(A_log, a, dt_bias) if lower_bound is None else gd.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    return g, beta


def _fits(q: mx.array, v: mx.array, mask: Any) -> bool:
    # What the kernels take; anything else (padding masks in a ragged
    # prefill) stays on mlx-lm's path.
    return mask is None and q.ndim == 4 and q.shape[-1] <= MAX_KEY_DIM and q.dtype in LOGIT_DTYPES and v.dtype == q.dtype


def _make_router(original: Callable) -> Callable:
    def routed_gated_delta_update(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        a: mx.array,
        b: mx.array,
        A_log: mx.array,
        dt_bias: mx.array,
        state: mx.array | None = None,
        mask: mx.array | None = None,
        *,
        use_kernel: bool = True,
        lower_bound: float | None = None,
        allow_neg_eigval: bool = False,
    ) -> tuple[mx.array, mx.array]:
        cap = _active[-1] if _active else None
        kw = {"use_kernel": use_kernel, "lower_bound": lower_bound, "allow_neg_eigval": allow_neg_eigval}
        on_cpu = mx.default_device() == mx.cpu
        if cap is None and not (on_cpu and q.shape[1] <= FUSED_MAX_T and _fits(q, v, mask)):
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)
        if cap is not None and not _fits(q, v, mask):
            raise ValueError(
                "gated-delta capture needs an unmasked chunk with Dk <= "
                f"{MAX_KEY_DIM} and one float dtype (q {tuple(q.shape)} {q.dtype}, mask {mask is not None})"
            )
        g, beta = _gates(a, b, A_log, dt_bias, lower_bound, allow_neg_eigval)
        if state is None:
            B, _, _, Dk = q.shape
            state = mx.zeros((B, v.shape[2], v.shape[3], Dk), dtype=mx.float32)
        y, states = _ext.gated_delta_capture(q, k, v, g, beta, state)
        if cap is not None:
            cache_id = cap.state_ids.get(id(state))
            if cache_id is None or cap.conv is None:
                raise RuntimeError("gated-delta capture: a layer's state or conv input is not one of the captured caches'")
            cap.by_cache[cache_id] = LayerCapture(cap.conv, states)
            cap.conv = None
        return y, states[:, -1]

    routed_gated_delta_update.mtplx_router = True  # type: ignore[attr-defined]
    return routed_gated_delta_update


def _conv_recorder(original: Callable) -> Callable:
    def call(self: nn.Conv1d, x: mx.array) -> mx.array:
        if _active:
            _active[-1].conv = x  # the GatedDeltaNet's [old conv state, inputs]
        return original(self, x)

    call.mtplx_router = True  # type: ignore[attr-defined]
    return call


@contextmanager
def route_gated_delta() -> Iterator[list[str]]:
    """Routes mlx-lm's GatedDeltaNet recurrence through the fused op (process-wide).

    Replaces `gated_delta_update` in every imported `mlx_lm.models.*` module
    that holds mlx-lm's own (qwen3_next, qwen3_5, ...), and lets captures see
    `nn.Conv1d` inputs, until the block ends. Nested use is a no-op.

    Yields:
        The names of the modules routed.
    """
    global _route_depth
    import mlx_lm.models.gated_delta as gd  # noqa: PLC0415
    import mlx_lm.models.qwen3_5  # noqa: F401, PLC0415
    import mlx_lm.models.qwen3_next  # noqa: F401, PLC0415

    if _route_depth > 0:
        _route_depth += 1
        try:
            yield []
        finally:
            _route_depth -= 1
        return
    original = gd.gated_delta_update
    router = _make_router(original)
    modules = [
        m
        for name, m in list(sys.modules.items())
        if m is not None and name.startswith("mlx_lm.models.") and name != gd.__name__
        and getattr(m, _FUNC, None) is original
    ]
    conv_call = nn.Conv1d.__call__
    for m in modules:
        setattr(m, _FUNC, router)
    nn.Conv1d.__call__ = _conv_recorder(conv_call)
    _route_depth = 1
    try:
        yield [m.__name__ for m in modules]
    finally:
        _route_depth = 0
        nn.Conv1d.__call__ = conv_call
        for m in modules:
            if getattr(m, _FUNC, None) is router:
                setattr(m, _FUNC, original)
