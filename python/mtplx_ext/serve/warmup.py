"""Warming up a started engine before the server reports ready.

MLX builds the kernels of each compiled step the first time it sees its
shapes (on the CPU backend by running the C++ compiler; seconds per kernel
on a machine whose kernel cache is cold). Without a warm-up the first
client pays that. The kernels differ by batch kind (greedy, sampled,
penalties) and by whether the batch has one row or more; prompt length, KV
capacity and the number of rows beyond one reuse them (measured on the CPU
backend: no new kernel for other prompt lengths, capacities or batch sizes).
So `warm_up` decodes short requests of each kind through the running engine,
alone and as a full batch, then clears what they left in the counters, the
statistics and the prefix cache, so `/metrics` starts at zero.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mtplx_ext.batching import Engine
from mtplx_ext.decode.results import BatchedDecodeResult
from mtplx_ext.sampling import SamplerConfig

#: Seconds one warm-up round may take before the server gives up on it (a cold cache compiles for a while).
ROUND_TIMEOUT_S = 300.0

_KINDS = {
    "greedy": SamplerConfig(temperature=0.0),
    "sampled": SamplerConfig(temperature=1.0, top_p=0.9),
    "penalties": SamplerConfig(temperature=1.0, frequency_penalty=0.5),
}


def _round(engine: Engine, sampler: SamplerConfig, rows: int, rng: np.random.Generator) -> None:
    prompt = [int(t) for t in rng.integers(0, engine.vocab, size=8)]
    max_tokens = 2 * (engine.depth + 1) + 2  # a few cycles
    reqs = [engine.submit(prompt, max_tokens=max_tokens, sampler=sampler, seed=i) for i in range(rows)]
    for r in reqs:
        if not r.wait(ROUND_TIMEOUT_S):
            raise RuntimeError(f"the warm-up did not finish in {ROUND_TIMEOUT_S:.0f} s")
        if r.error:
            raise RuntimeError(f"the warm-up failed: {r.error}")


def _until_idle(engine: Engine, timeout: float = 30.0) -> None:
    """Until the engine dropped the finished rows (it does at the step after their last token)."""
    deadline = time.monotonic() + timeout
    while (engine.live_streams or engine.kv_slots) and time.monotonic() < deadline:
        time.sleep(0.005)


def warm_up(engine: Engine) -> tuple[float, str]:
    """Runs the warm-up rounds on a started engine; returns (seconds taken, what was warmed)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng()
    engine.prefix.disk_writes = False  # warm-up prompts are not worth a file
    for sampler in _KINDS.values():
        for rows in sorted({1, engine.max_batch}):
            _round(engine, sampler, rows, rng)
    _until_idle(engine)
    for k in engine.counters:
        engine.counters[k] = 0
    engine.stats = BatchedDecodeResult(depth=engine.stats.depth)
    engine.prefix.reset()  # (writes to its disk tier again)
    what = f"{', '.join(_KINDS)} at batch " + " and ".join(str(b) for b in sorted({1, engine.max_batch}))
    return time.perf_counter() - t0, what


__all__ = ["ROUND_TIMEOUT_S", "warm_up"]
