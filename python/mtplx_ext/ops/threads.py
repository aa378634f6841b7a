"""The CPU kernels' thread pool: how many threads the fused CPU primitives use.

The count comes from `MTPLX_CPU_THREADS` (read once per process) or the CPUs
this process may run on. `set_cpu_threads(n)` overrides it in-process (tests,
side-by-side measurements; 0 restores the default); each primitive's result
is the same at any thread count.
"""

from __future__ import annotations

from mtplx_ext import _ext
from mtplx_ext._checks import as_int


def cpu_threads() -> int:
    """Threads the CPU kernels use now (ValueError for a bad MTPLX_CPU_THREADS)."""
    return int(_ext.cpu_threads())


def set_cpu_threads(n: int) -> int:
    """Uses `n` threads from now on (0: back to the default); returns the previous override."""
    return int(_ext.set_cpu_threads(as_int("n", n)))


def cpu_pool_jobs() -> int:
    """Jobs the pool has run in this process (to check that a kernel went parallel)."""
    return int(_ext.cpu_pool_jobs())


__all__ = ["cpu_pool_jobs", "cpu_threads", "set_cpu_threads"]
