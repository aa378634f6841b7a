"""Memory read bandwidth and the weight-streaming floor of a decode step.

At decode a memory-bound model reads every weight once per forward, so
`weight bytes / read bandwidth` is a lower bound on a plain step's time on
this machine, whatever the kernels do. Benchmarks print it beside the
measured step to say how far a step is from memory-bound.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

#: Default buffer: far beyond the last-level caches of CPUs of today.
DEFAULT_BYTES = 1 << 30


def read_bandwidth(nbytes: int = DEFAULT_BYTES, repeats: int = 5, threads: int | None = None) -> float:
    """This machine's sustained memory read rate, in bytes per second.

    Streams a float32 buffer of `nbytes` with NumPy's max reduction (a plain
    vectorised pass: `sum` is pairwise and, on a fast memory system, bound by
    its additions rather than by the reads), cut into one slice per thread,
    the threads reading at once (NumPy releases the GIL). A decode step reads
    its weights on every core it has (the decode GEMM splits large products
    over two threads), so the floor uses the rate all cores reach together.
    Each repeat times one full pass and the median pass is reported, after
    one untimed pass that faults the pages in. The buffer should be much
    larger than the caches (the default 1 GiB is), else the caches' rate is
    measured.

    Args:
        nbytes: buffer size in bytes (>= 4; rounded down to whole float32s).
        repeats: timed passes (>= 1).
        threads: reading threads (>= 1; default: the CPUs this process may run on).

    Returns:
        Bytes read per second of the median pass.

    Raises:
        ValueError: nbytes < 4, repeats < 1 or threads < 1.
    """
    nbytes, repeats = int(nbytes), int(repeats)
    if nbytes < 4:
        raise ValueError(f"nbytes must be >= 4, got {nbytes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if int(threads) < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    buf = np.ones(nbytes // 4, dtype=np.float32)
    parts = np.array_split(buf, min(int(threads), buf.size))
    with ThreadPoolExecutor(len(parts)) as pool:

        def one_pass() -> None:
            list(pool.map(np.max, parts))

        one_pass()  # faults the pages in
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            one_pass()
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
