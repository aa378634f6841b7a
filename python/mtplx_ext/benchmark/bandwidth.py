"""Memory read bandwidth and the weight-streaming floor of a decode step.

At decode a memory-bound model reads every weight once per forward, so
`weight bytes / read bandwidth` is a lower bound on a plain step's time on
this machine, whatever the kernels do. Benchmarks print it beside the
measured step to say how far a step is from memory-bound.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

#: Default buffer: far beyond the last-level caches of CPUs of today.
DEFAULT_BYTES = 1 << 30


def read_bandwidth(nbytes: int = DEFAULT_BYTES, repeats: int = 5) -> float:
    """This process's sustained memory read rate, in bytes per second.

    Sums a float64 buffer of `nbytes` (NumPy, one thread: the rate a
    single-process decode step sees); each repeat times one full pass and
    the median pass is reported, after one untimed pass that faults the
    pages in. The buffer should be much larger than the caches (the default
    1 GiB is), else the caches' rate is measured.

    Args:
        nbytes: buffer size in bytes (>= 8; rounded down to whole float64s).
        repeats: timed passes (>= 1).

    Returns:
        Bytes read per second of the median pass.

    Raises:
        ValueError: nbytes < 8 or repeats < 1.
    """
    nbytes, repeats = int(nbytes), int(repeats)
    if nbytes < 8:
        raise ValueError(f"nbytes must be >= 8, got {nbytes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    buf = np.ones(nbytes // 8, dtype=np.float64)
    buf.sum()  # faults the pages in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.nbytes / max(statistics.median(times), 1e-12)


def weight_bytes(model: Any) -> int:
    """Bytes of every parameter of an MLX module, or of an `MTPRuntime`'s trunk.

    For a runtime only the trunk counts (a plain decode step reads the
    trunk, lm_head included, not the MTP head); pass `runtime.head` for the
    head's own bytes. Quantized layers count their packed weights, scales and
    biases as stored.
    """
    from mlx.utils import tree_flatten

    module = getattr(model, "trunk", model)
    return int(sum(v.nbytes for _, v in tree_flatten(module.parameters())))


def streaming_floor_s(weight_bytes: int, bandwidth: float) -> float:
    """Seconds a step needs just to read `weight_bytes` at `bandwidth` bytes/s.

    Raises:
        ValueError: a negative byte count or a bandwidth that is not positive.
    """
    if weight_bytes < 0:
        raise ValueError(f"weight_bytes must be >= 0, got {weight_bytes}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    return weight_bytes / bandwidth
