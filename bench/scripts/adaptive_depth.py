"""depth="auto" following the served text's acceptance, against the calibration's K alone.

The Engine's `depth="auto"` calibrates K per batch size on greedy decodes of
a few code openings (`engine.autodepth`) and then follows the acceptance it
sees (`batching.depths`). This runs the same requests through two engines
of the same calibration, interleaved per repeat: "adaptive" (as shipped)
and "calibrated" (`BatchDepths.freeze()`: the calibration's K throughout).
Requests are held-out code prompts, `--requests` at once, at most
`--concurrency` decoding (continuous batching), greedy or sampled at
`--temperature` (sampling accepts fewer drafts than the greedy calibration
saw, so its best K is shallower). Prints tokens/s (medians of the repeats),
the ratio adaptive / calibrated from the same repeats, the acceptance seen
and the K each engine's cycles ran.

Run: python bench/scripts/adaptive_depth.py [--model DIR] [--concurrency 1,4] [--temperature 0,1]
     [--requests 8] [--tokens 64] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine
from mtplx_ext.benchmark import harness
from mtplx_ext.shipped import SHIPPED_MODEL
from mtplx_ext.benchmark.provenance import provenance

MODES = ("adaptive", "calibrated")


def one_run(rt, prompts, concurrency: int, tokens: int, temperature: float, mode: str, seed: int) -> dict:
    eng = Engine(rt, max_batch=concurrency, depth="auto")
    if mode == "calibrated" and eng._depths is not None:  # the engine's K policy (public methods below)
        eng._depths.freeze()
    sampler = None if temperature == 0 else SamplerConfig(temperature=temperature)
    ks: collections.Counter = collections.Counter()
    t = time.perf_counter()
    with eng.session():
        reqs = [eng.submit(p, max_tokens=tokens, sampler=sampler, seed=seed + i) for i, p in enumerate(prompts)]
        while eng.step():
            if eng.live_streams:
                ks[eng.cycle_depth] += 1
    wall = time.perf_counter() - t
    assert all(r.error is None for r in reqs), [r.error for r in reqs if r.error]
    m = eng.metrics()
    return {"tokens_per_s": sum(len(r.tokens) for r in reqs) / wall, "acceptance": m["acceptance"],
            "mean_accepted_length": m["mean_accepted_length"], "k_cycles": dict(sorted(ks.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--temperature", default="0,1")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rt = mtplx_ext.load(a.model or SHIPPED_MODEL)
    tok = rt.tokenizer
    prompts = harness.heldout_prompts(tok, a.requests, a.prompt_tokens, seed=7)
    concs = [int(c) for c in a.concurrency.split(",")]
    temps = [float(x) for x in a.temperature.split(",")]
    for c in concs:  # calibrate (cached) and warm every batch shape once
        for mode in MODES:
            one_run(rt, prompts[: max(2, c)], c, 16, temps[-1], mode, 0)
    rows = []
    for c in concs:
        for temp in temps:
            runs: dict[str, list[dict]] = {m: [] for m in MODES}
            for rep in range(a.repeats):
                for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                    runs[mode].append(one_run(rt, prompts, c, a.tokens, temp, mode, 1000 * rep))
            med = {m: statistics.median(r["tokens_per_s"] for r in runs[m]) for m in MODES}
            ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs["adaptive"], runs["calibrated"])]
            rows.append({"concurrency": c, "temperature": temp, "runs": runs, "tokens_per_s": med,
                         "ratio_median": statistics.median(ratios), "ratios": ratios})
    print(f"model: {a.model or 'shipped'}; {a.requests} held-out prompts of {a.prompt_tokens} tokens, {a.tokens} new "
          f"tokens each, medians of {a.repeats} interleaved repeats; {harness.versions()}")
    print("| concurrency | temperature | adaptive tok/s | calibrated tok/s | adaptive / calibrated (per repeat) "
          "| acceptance | K cycles, adaptive | K cycles, calibrated |")
    print("|---:|---:|---:|---:|---|---:|---|---|")
    for r in rows:
        ad, ca = r["runs"]["adaptive"][-1], r["runs"]["calibrated"][-1]
        per = ", ".join(f"{x:.2f}" for x in r["ratios"])
        print(f"| {r['concurrency']} | {r['temperature']:g} | {r['tokens_per_s']['adaptive']:.1f} | "
              f"{r['tokens_per_s']['calibrated']:.1f} | **{r['ratio_median']:.2f}** ({per}) | {ad['acceptance']:.2f} | "
              f"{ad['k_cycles']} | {ca['k_cycles']} |")
    if a.json:
        a.json.write_text(json.dumps({"command": "python bench/scripts/adaptive_depth.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None and k != "json"),
            "versions": harness.versions(), "rows": rows, "provenance": provenance([a.model])}, indent=1))


if __name__ == "__main__":
    main()
