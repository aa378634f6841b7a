"""The continuous-batching Engine on a trained hybrid model: MTP on vs off, side by side.

A trained hybrid model (GatedDeltaNet trunk + MTP head; default
bench/models/tiny-qwen3-next-mtp), held-out prompts cut from Python stdlib files
it was not trained on, greedy. Per repeat, interleaved: `--requests`
requests submitted at once to an `Engine` (max_batch = requests), stepped
on this thread until all finish, plain decoding (`use_mtp=False`) and MTP
at each depth. One engine per configuration, kept across repeats as a
server keeps it; each runs once untimed first (traces of its batch shapes,
kernels).
Medians over repeats of generated tokens / wall second (submit to last
token, prefill included) and of time to first token.

Run: python bench/scripts/engine_hybrid.py [--model DIR] [--requests 8] [--depth 1,2] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import statistics
import time
from pathlib import Path

from mtplx_ext import _blas
from mtplx_ext.batching import Engine
from mtplx_ext import benchmark

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-next-mtp"


def run(eng, prompts, n):
    before = eng.metrics()
    t0 = time.perf_counter()
    reqs = [eng.submit(p, max_tokens=n) for p in prompts]
    eng.run_until_idle()
    secs = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in reqs)
    cycles = sum(r.cycles for r in reqs)
    after = eng.metrics()
    # Rows computed by the decode forwards per token they produced (the first
    # token of each request comes from its prefill).
    rows = after["row_forwards"] - before["row_forwards"]
    return {"tps": tokens / secs, "ttft": statistics.median(r.first_token_s - r.submitted_s for r in reqs),
            "L": sum(r.accepted for r in reqs) / cycles if cycles else 0.0,
            "cycles": after["cycles"] - before["cycles"], "fpt": rows / max(1, tokens - len(reqs)),
            "out": [r.tokens for r in reqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--depth", default="1,2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rt = mtplx_ext.load(args.model)
    prompts = benchmark.heldout_prompts(rt.tokenizer, args.requests, 48, seed=0)
    configs = [("plain", False, 1)] + [(f"MTP depth {d}", True, int(d)) for d in args.depth.split(",")]
    # One engine per configuration, as a server keeps it: its batch shapes are traced once.
    engines = {name: Engine(rt, max_batch=len(prompts), depth=depth, use_mtp=mtp) for name, mtp, depth in configs}
    for eng in engines.values():
        run(eng, prompts, args.tokens)  # warm-up: traces and kernels
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, eng in engines.items():
            results[name].append(run(eng, prompts, args.tokens))
    print(f"BLAS: {_blas.describe()}; {args.requests} held-out prompts submitted at once, {args.tokens} new "
          f"tokens each, greedy, medians of {args.repeats} interleaved repeats")
    print("| engine | tokens/s | x plain | time to first token (ms) | mean accepted length | cycles "
          "| row forwards / token | 1 / (1 + L) | same tokens as plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    base = statistics.median(r["tps"] for r in results["plain"])
    plain_out = results["plain"][0]["out"]
    for name, runs in results.items():
        tps = statistics.median(r["tps"] for r in runs)
        same = sum(a == b for a, b in zip(runs[0]["out"], plain_out))
        print(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {statistics.median(r['ttft'] for r in runs) * 1e3:.1f} "
              f"| {runs[0]['L']:.2f} | {runs[0]['cycles']} | {runs[0]['fpt']:.3f} | {1 / (1 + runs[0]['L']):.3f} "
              f"| {same}/{len(plain_out)} |")


if __name__ == "__main__":
    main()
