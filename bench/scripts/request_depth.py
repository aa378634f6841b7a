"""Per-request MTP depth: cycles, accepted drafts and tokens/s of one batch at each request depth.

One engine at --depth K decodes the same --batch greedy prompts with every
request at depth d (0..K; `Engine.submit(depth=d)`), the depths interleaved
over --repeats rounds after a warm-up of every batch shape; medians. The
tokens must equal at every depth (greedy).

Run: python bench/scripts/request_depth.py [--model DIR] [--depth 2] [--batch 4] [--tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mtplx_ext  # first: loads the fast BLAS before mlx.core
from mtplx_ext.batching import Engine
from mtplx_ext.shipped import BENCH_PROMPTS, SHIPPED_MODEL
from mtplx_ext.benchmark.provenance import provenance


def run(eng: Engine, prompts: list[list[int]], tokens: int, depth: int) -> dict:
    reqs = [eng.submit(p, max_tokens=tokens, depth=depth) for p in prompts]
    c0, t0 = eng.cycle_count, time.perf_counter()
    eng.run_until_idle()
    dt = time.perf_counter() - t0
    n = sum(len(r.tokens) for r in reqs)
    return {"tokens_per_s": n / dt, "cycles": eng.cycle_count - c0, "accepted": sum(r.accepted for r in reqs),
            "generated": n, "ids": [r.tokens for r in reqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rt = mtplx_ext.load(a.model)
    prompts = [rt.tokenizer.encode(BENCH_PROMPTS[i % len(BENCH_PROMPTS)]).ids for i in range(a.batch)]
    eng = Engine(rt, max_batch=a.batch, depth=a.depth)
    depths = list(range(a.depth, -1, -1))
    for d in depths:
        run(eng, prompts, a.tokens, d)  # warm-up: every batch shape traced
    runs: dict[int, list[dict]] = {d: [] for d in depths}
    for _ in range(a.repeats):
        for d in depths:
            runs[d].append(run(eng, prompts, a.tokens, d))
    same = all(r["ids"] == runs[a.depth][0]["ids"] for rs in runs.values() for r in rs)
    rows = [{"depth": d, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
             "cycles": rs[0]["cycles"], "accepted": rs[0]["accepted"], "generated": rs[0]["generated"]}
            for d, rs in runs.items()]
    print(f"engine depth {a.depth}, batch {a.batch}, {a.tokens} tokens each; tokens equal at every depth: {same}")
    print("| request depth | cycles | accepted drafts | tokens/s |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['depth']} | {r['cycles']} | {r['accepted']} | {r['tokens_per_s']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "same_tokens": same, "rows": rows, "provenance": provenance([a.model])}, f,
                      indent=1)


if __name__ == "__main__":
    main()
