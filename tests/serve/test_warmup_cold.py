"""On a cold MLX kernel cache, the server's warm-up builds every kernel its first requests need.

MLX's CPU backend compiles the kernels of compiled steps with the C++
compiler into a cache under the temp directory; with TMPDIR pointing at an
empty folder the server starts cold. After it reports ready, a mix of
requests (each batch kind, alone and batched, other prompt lengths and
budgets, chat and completions, streamed or not) must add no kernel to the
cache. The cold warm-up compiles for minutes on a loaded 2-core machine,
so this test runs only with MTPLX_COLD_START_TEST=1.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import httpx
import pytest

from _live_server import spawn, stop, wait_ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MTPLX_COLD_START_TEST") != "1",
                       reason="compiles MLX's CPU kernels from scratch (minutes); set MTPLX_COLD_START_TEST=1"),
]


def _kernels(tmp) -> set[str]:
    return {p.name for p in tmp.rglob("*.so")}


def test_after_a_cold_warm_up_the_first_requests_compile_nothing(tmp_path):
    proc, base = spawn("--max-batch", "4", "--depth", "2", env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        wait_ready(proc, base, timeout=900)
        built = _kernels(tmp_path)
        assert built  # the warm-up compiled them

        def one(i: int) -> float:
            body = {"prompt": "def f(x):\n    " * (1 + i % 5), "max_tokens": 5 + 7 * i, "stream": i % 3 == 0,
                    "temperature": [0, 0.8, 1.0][i % 3], "seed": i}
            if i % 3 == 2:
                body["frequency_penalty"] = 0.4
            t = time.time()
            path = "/v1/completions"
            if i % 4 == 3:
                path = "/v1/chat/completions"
                body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
            assert httpx.post(base + path, json=body, timeout=300).status_code == 200
            return time.time() - t

        first = [one(i) for i in range(3)]  # each kind alone
        with cf.ThreadPoolExecutor(4) as pool:
            batched = list(pool.map(one, range(3, 15)))
        assert _kernels(tmp_path) == built, sorted(_kernels(tmp_path) - built)
        assert max(first + batched) < 10, (first, batched)
    finally:
        assert stop(proc) == 0
    warm = [line for line in proc.stdout.read().decode().splitlines() if "warmed up in" in line]
    print(warm, f"{len(built)} kernels built, first requests {max(first + batched):.2f} s at most")
