"""What logprobs and a logit bias cost per generated token in the Engine (shipped model, MTP on).

Runs the same greedy requests three ways: plain, every request asking for
logprobs (5 alternatives), every request with a 3-entry logit bias; prints
tokens/s (median of --repeats runs) for each batch size. Usage:

    python bench/scripts/logprobs_bias_cost.py [--batch 1 4] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine
from mtplx_ext.shipped import SHIPPED_MODEL


def run(rt, B: int, tokens: int, mode: str, depth: int) -> float:
    rng = np.random.default_rng(0)
    eng = Engine(rt, max_batch=B, depth=depth)
    bias = {int(t): -2.0 for t in rng.integers(rt.vocab_size, size=3)} if mode == "bias" else {}
    cfg = SamplerConfig(temperature=0.0, logit_bias=bias)
    with eng.session():
        reqs = [eng.submit(rng.integers(0, rt.vocab_size, size=16).tolist(), max_tokens=tokens, sampler=cfg,
                           logprobs=5 if mode == "logprobs" else None) for _ in range(B)]
        t0 = time.perf_counter()
        eng.run_until_idle()
        dt = time.perf_counter() - t0
    return sum(len(r.tokens) for r in reqs) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2)
    a = ap.parse_args()
    rt = mtplx_ext.load(SHIPPED_MODEL)
    run(rt, 1, 8, "plain", a.depth)  # warm-up: kernels and compiled steps
    for B in a.batch:
        row = {}
        for mode in ("plain", "logprobs", "bias"):
            run(rt, B, 8, mode, a.depth)
            row[mode] = statistics.median(run(rt, B, a.tokens, mode, a.depth) for _ in range(a.repeats))
        print(f"batch {B}: " + ", ".join(f"{m} {v:.1f} tok/s" for m, v in row.items())
              + f" (logprobs {row['logprobs'] / row['plain']:.2f}x, bias {row['bias'] / row['plain']:.2f}x plain)")


if __name__ == "__main__":
    main()
