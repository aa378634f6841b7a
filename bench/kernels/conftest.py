"""Collects benchmark medians and prints side-by-side speed ratios."""

from __future__ import annotations

import mtplx_ext  # first: loads the fast BLAS before mlx.core
from mtplx_ext.ops import threads

import os
from collections import defaultdict

import pytest

# (table, case) -> {implementation: median seconds}
MEDIANS: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
BASELINES = ("composed_mlx", "host_numpy", "numpy_argmax", "host_float64")


@pytest.fixture
def record(benchmark):
    """Runs `fn` under pytest-benchmark and files its median for the ratio table."""

    def run(table: str, case: str, impl: str, fn, rounds: int = 30):
        benchmark.group = f"{table} {case}"
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=3)
        MEDIANS[(table, case)][impl] = benchmark.stats.stats.median

    return run


def pytest_terminal_summary(terminalreporter):
    if not MEDIANS:
        return
    tr = terminalreporter
    tr.section("speed ratios (median time of baseline / median time of fused)")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    if any("fused_1thread" in impls for impls in MEDIANS.values()):
        kernels = f"CPU kernel threads: {threads.cpu_threads()} (fused); fused_1thread: 1; "
    else:
        kernels = ""
    tr.write_line(f"{kernels}load average at the end: {load}")
    for (table, case), impls in sorted(MEDIANS.items()):
        fused = impls.get("fused")
        single = impls.get("fused_1thread")
        parts = [f"fused {fused * 1e3:.3f} ms" if fused else "fused -"]
        if single:
            parts.append(f"fused_1thread {single * 1e3:.3f} ms")
        for name in BASELINES:
            if name in impls and fused:
                ratio = f"{impls[name] / fused:.1f}x"
                if single:
                    ratio += f"; 1 thread {impls[name] / single:.1f}x"
                parts.append(f"{name} {impls[name] * 1e3:.3f} ms ({ratio})")
        tr.write_line(f"{table:14s} {case:28s} " + "  ".join(parts))
