"""Collects benchmark medians and prints side-by-side speed ratios."""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

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
    for (table, case), impls in sorted(MEDIANS.items()):
        fused = impls.get("fused")
        parts = [f"fused {fused * 1e3:.3f} ms" if fused else "fused -"]
        for name in BASELINES:
            if name in impls and fused:
                parts.append(f"{name} {impls[name] * 1e3:.3f} ms ({impls[name] / fused:.1f}x)")
        tr.write_line(f"{table:14s} {case:28s} " + "  ".join(parts))
