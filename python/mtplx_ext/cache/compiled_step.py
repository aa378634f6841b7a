"""CompiledStep: a decode step traced once by `mx.compile` and replayed.

Over fixed-capacity `RaggedKVCache`s (writes at device-side ends, masks over
every slot) a decode step builds the same graph each cycle. Traced once,
each later call skips Python graph building and runs MLX's fused
element-wise kernels; on MLX's CPU backend a small decode forward is bound
by exactly that per-node work.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from mtplx_ext._checks import as_int
from mtplx_ext.cache.ragged import RaggedKVCache, RaggedPositions


class CompiledStep:
    """Compiles `fn(*inputs)`, a step that reads and updates `cache_lists`.

    The caches' arrays (per-stream ends, keys and values) and the `holders`'
    array attributes become explicit inputs and outputs of the compiled
    function, so each call goes on from the state the previous one left, and
    the caches and holders keep that state between calls.

    The caches' host-side bookkeeping (`size()`, the layer ticks) only moves
    while Python runs, i.e. at a trace, so the caches stop trusting `size()`
    as a bound once a step owns them. The caller knows how many slots the
    next call may write and says so with `reserve`: the caches then grow (by
    `grow_step` slots or more), and the new shapes make `mx.compile` trace
    the step once more. So a decode with a large token budget holds only
    the slots it has used, rounded up.

    Args:
        fn: builds the step's graph from array inputs and returns an array
            or a tuple of arrays; it must change every layer of the caches
            alike on every call (as a decode step does).
        cache_lists: cache lists whose layers are allocated fixed-capacity
            `RaggedKVCache`s or recurrent `ArraysCache`s past their prompt
            (every leaf set, no padding mask), e.g. after the prefill.
        holders: (object, attribute) pairs of other device state the step
            reads or replaces, e.g. a token policy's penalty counts; each
            must hold an array.
        grow_step: slots added (at least) when the caches must grow.

    Attributes:
        traces: how many times Python built the step (1 + one per growth
            in a decode; more means the step is not being replayed).

    Raises:
        ValueError: naming a layer that is not such a cache, or a holder
            attribute that is not an array.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        cache_lists: Sequence[Sequence[Any]],
        holders: Sequence[tuple[Any, str]] = (),
        grow_step: int = 256,
    ):
        self._grow_step = as_int("grow_step", grow_step, lo=1)
        self.traces = 0
        self._n_out = 0
        self._tuple_out = False
        self.bind(fn, cache_lists, holders)
        self._compiled = mx.compile(self._traced)

    def bind(
        self, fn: Callable[..., Any], cache_lists: Sequence[Sequence[Any]], holders: Sequence[tuple[Any, str]] = ()
    ) -> None:
        """Points the step at new caches and holders of the same structure.

        The compiled graph is kept: calls with inputs of the shapes seen
        before replay it without tracing again (a later decode of the same
        model, batch and kind of step). `fn` must build the graph the
        replaced one built, on the new caches (it runs again only if a new
        input shape makes `mx.compile` trace).

        Raises:
            ValueError: naming a layer that is not such a cache, or a holder
                attribute that is not an array.
        """
        layers: list[RaggedKVCache] = []
        positions: list[RaggedPositions] = []
        recurrent: list[ArraysCache] = []
        for i, caches in enumerate(cache_lists):
            for j, c in enumerate(caches):
                if isinstance(c, ArraysCache):
                    if any(a is None for a in c.cache) or c.left_padding is not None or c.lengths is not None:
                        raise ValueError(
                            f"cache_lists[{i}][{j}] (ArraysCache) is still in its prompt phase "
                            "(empty state or a padding mask: run the prefill and finish_prefill first)"
                        )
                    recurrent.append(c)
                    continue
                if not isinstance(c, RaggedKVCache) or c.positions.capacity is None:
                    raise ValueError(
                        f"cache_lists[{i}][{j}] ({type(c).__name__}) is neither a fixed-capacity "
                        "RaggedKVCache nor an ArraysCache"
                    )
                if c.keys is None:
                    raise ValueError(f"cache_lists[{i}][{j}] is not allocated yet (run the prefill first)")
                layers.append(c)
                if all(p is not c.positions for p in positions):
                    positions.append(c.positions)
        for obj, name in holders:
            if not isinstance(getattr(obj, name, None), mx.array):
                raise ValueError(f"holder {type(obj).__name__}.{name} is not an mx.array")
        for p in positions:
            p.host_bound = False  # replays move the ends without Python
        self._layers, self._positions, self._recurrent = layers, positions, recurrent
        self._holders = list(holders)
        self._fn = fn

    def release(self) -> None:
        """Drops the references to the bound caches, holders and `fn` (their memory can go)."""
        self._layers, self._positions, self._recurrent, self._holders = [], [], [], []
        self._fn = None

    @property
    def released(self) -> bool:
        """True after `release` until the next `bind`: free to serve another decode."""
        return self._fn is None

    def state(self) -> list[mx.array]:
        """The arrays the step takes and returns (new handles: safe to keep)."""
        return [mx.array(a) for a in self._state()]

    def load(self, state: Sequence[mx.array]) -> None:
        """Puts back a `state()` (e.g. to drop a step that was built and never run)."""
        self._load(list(state))

    def _state(self) -> list[mx.array]:
        # The last-slot arrays only pass through: as inputs, MLX never bakes
        # their value into a fused kernel (which it would recompile per value).
        # Left paddings are inputs too: a replay for another batch of the
        # same shape (`bind`) must not keep the traced batch's paddings.
        return (
            [p.ends for p in self._positions]
            + [p.last_slot for p in self._positions]
            + [p.left_padding for p in self._positions]
            + [a for c in self._layers for a in c.buffers]
            + [a for c in self._recurrent for a in c.cache]
            + [getattr(obj, name) for obj, name in self._holders]
        )

    def _load(self, state: Sequence[mx.array]) -> None:
        n = len(self._positions)
        for i, p in enumerate(self._positions):
            p.load(state[i], state[n + i], state[2 * n + i])
        base = 3 * n
        for c in self._layers:
            k = len(c.buffers)
            c.buffers = list(state[base : base + k])
            base += k
        for c in self._recurrent:
            k = len(c.cache)
            c.cache = list(state[base : base + k])
            base += k
        for i, (obj, name) in enumerate(self._holders):
            setattr(obj, name, state[base + i])

    def _traced(self, *args: mx.array) -> list[mx.array]:
        n_state = len(self._state())
        self._load(args[:n_state])
        out = self._fn(*args[n_state:])
        self.traces += 1
        self._tuple_out = isinstance(out, tuple)
        outs = list(out) if self._tuple_out else [out]
        self._n_out = len(outs)
        return outs + self._state()

    def reserve(self, slots: int) -> None:
        """Grows the caches, if needed, so that every stream has `slots` slots."""
        slots = as_int("slots", slots, lo=0)
        for p in self._positions:
            if slots > p.capacity:
                grown = p.capacity + self._grow_step * -(-(slots - p.capacity) // self._grow_step)
                for c in self._layers:
                    if c.positions is p:
                        c.grow(grown)
                p.set_capacity(grown)

    def __call__(self, *inputs: mx.array) -> Any:
        """Runs the step (lazily, like any MLX op) and moves the caches on."""
        res = self._compiled(*self._state(), *inputs)
        n = self._n_out
        self._load(res[n:])
        return tuple(res[:n]) if self._tuple_out else res[0]


def weight_ids(module: Any) -> tuple[int, ...]:
    """The ids of a module's parameter arrays, in `tree_flatten(module.parameters())` order.

    A traced step holds the weights it was traced with, so a kept step may
    serve a later decode only while the module holds the same arrays. This
    walks the module's own dicts and lists with `Module.parameters`' rule
    (keys starting with "_" left out) without building the nested dicts
    `parameters()` returns, which took most of a decode's set-up time.
    """
    out: list[int] = []

    def walk(v: Any) -> None:
        if isinstance(v, mx.array):
            out.append(id(v))
        elif isinstance(v, nn.Module):
            for k, x in v.items():
                if not k.startswith("_") and isinstance(x, (dict, list, mx.array)):
                    walk(x)
        elif isinstance(v, (dict, list)):
            for x in (v.values() if isinstance(v, dict) else v):
                if isinstance(x, (dict, list, mx.array)):
                    walk(x)

    # (An object standing for a module, e.g. a wrapper of a runtime, answers for its weights by `parameters()`.)
    walk(module if isinstance(module, nn.Module) else module.parameters())
    return tuple(out)


def mlx_kernel_cache_dir() -> Path:
    """Where MLX's CPU backend keeps the fused kernels it builds with the C++ compiler."""
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


__all__ = ["CompiledStep", "mlx_kernel_cache_dir", "weight_ids"]
