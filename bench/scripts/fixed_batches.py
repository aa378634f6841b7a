"""Fixed batches on the engine (`generate_batched`) against the reference loop, side by side.

For each model, batch size and decoding mode (plain, MTP at the K
depth="auto" picks for that batch here), decodes the bench prompts with
`mtplx_ext.generate_batched` (the engine: one group prefill, the engine's
cycle) and `mtplx_ext.decode.generate_reference` (the loop fixed batches ran
before) back to back in each round, the order alternating; reports medians
of end-to-end tokens/s (wall time of the call, prefill included) and of the
per-round ratio engine / reference, with a 95% bootstrap interval over the
rounds; and the ratio of decode-only tokens/s (the result's `decode_s`, what
`mtplx-ext bench` reports). Every round checks both give the same tokens
(greedy).

Run: python bench/scripts/fixed_batches.py [--model shipped|FOLDER ...] [--batch 1,8] [--tokens 64]
     [--rounds 5] [--json bench/results/fixed_batches.json]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from mtplx_ext import benchmark
from mtplx_ext.benchmark.provenance import provenance
from mtplx_ext.decode import generate_greedy_reference
from mtplx_ext.decode.generate import auto_depth
from mtplx_ext.shipped import BENCH_PROMPTS, SHIPPED_MODEL


def bootstrap_median(per: np.ndarray, resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of the per-round ratios (seeded: replayable)."""
    rng = np.random.default_rng(0)
    boot = np.median(per[rng.integers(0, len(per), size=(resamples, len(per)))], axis=1)
    return float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def run(rt, prompts, tokens: int, mtp: bool, depth: int, engine: bool) -> tuple[float, float, list[list[int]]]:
    """End-to-end and decode-only tokens/s of one call, and its tokens."""
    f = mtplx_ext.generate_greedy_batched if engine else generate_greedy_reference
    t = time.perf_counter()
    r = f(rt, prompts, max_new_tokens=tokens, use_mtp_draft=mtp, depth=depth)
    wall = time.perf_counter() - t
    return r.generated_tokens / wall, r.generated_tokens / r.decode_s, [s.tokens for s in r.streams]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["shipped"])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print("| model | batch | decoding | reference tok/s | engine tok/s | engine / reference | 95% interval | "
          "decode-only ratio | 95% interval | same tokens |")
    print("|---|---:|---|---:|---:|---:|---|---:|---|---:|")
    for name in args.model:
        folder = SHIPPED_MODEL if name == "shipped" else name
        rt = mtplx_ext.load(folder)
        label = name if name == "shipped" else Path(name).name  # (the folder's weights are in the provenance)
        for batch in (int(b) for b in args.batch.split(",")):
            prompts = [rt.tokenizer.encode(BENCH_PROMPTS[i % len(BENCH_PROMPTS)]).ids for i in range(batch)]
            k = auto_depth(rt, batch)
            for mtp in (False, True):
                if mtp and k == 0:
                    continue
                tps: dict[bool, list[float]] = {True: [], False: []}
                dec: dict[bool, list[float]] = {True: [], False: []}
                same = True
                for r in range(args.rounds + 1):  # round 0 warms up (traces, kernels)
                    outs = {}
                    for engine in ((True, False) if r % 2 else (False, True)):
                        t, d, outs[engine] = run(rt, prompts, args.tokens, mtp, max(k, 1), engine)
                        if r:
                            tps[engine].append(t)
                            dec[engine].append(d)
                    same &= outs[True] == outs[False]
                per = np.array(tps[True]) / np.array(tps[False])
                low, high = bootstrap_median(per)
                per_dec = np.array(dec[True]) / np.array(dec[False])
                dlow, dhigh = bootstrap_median(per_dec)
                row = {"model": label, "batch": batch, "mtp": mtp, "depth": k if mtp else 0,
                       "reference_tps": statistics.median(tps[False]), "engine_tps": statistics.median(tps[True]),
                       "ratio": float(np.median(per)), "low": low, "high": high, "rounds": per.tolist(),
                       "decode_ratio": float(np.median(per_dec)), "decode_low": dlow, "decode_high": dhigh,
                       "decode_rounds": per_dec.tolist(), "same_tokens": same}
                rows.append(row)
                print(f"| {label} | {batch} | {'MTP K=' + str(k) if mtp else 'plain'} | {row['reference_tps']:.1f} | "
                      f"{row['engine_tps']:.1f} | {row['ratio']:.2f} | {low:.2f}-{high:.2f} | "
                      f"{row['decode_ratio']:.2f} | {dlow:.2f}-{dhigh:.2f} | {'yes' if same else 'NO'} |",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "tokens": args.tokens, "rounds": args.rounds, "versions": benchmark.versions(),
                       "provenance": provenance([SHIPPED_MODEL if m == "shipped" else m for m in args.model])},
                      f, indent=2)


if __name__ == "__main__":
    main()
