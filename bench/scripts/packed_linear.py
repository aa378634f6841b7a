"""Packed against row-major Linear weights, end to end: the same model decoded both ways, side by side.

Loads the model twice, once as `mtplx_ext.load` leaves it (float32 Linear
layers packed for the CPU decode GEMM) and once with `unpack_cpu_linears`
(row-major weights, products through the BLAS shim's decode GEMM), and
decodes the same held-out prompts greedily with each, plain and at every
`--depth`, at every `--batch` (every prompt at every batch size), the
settings interleaved in each of `--repeats` rounds after one warm-up round.
Prints tokens/s (medians over the rounds), each setting's speed-up from
packing, MTP's speed-up over plain decoding of the same layout, and whether
the two layouts decoded the same tokens.

Run: python bench/scripts/packed_linear.py --model GROWN [--batch 1,8] [--depth 2,3,4] [--tokens 64]
         [--prompts 8] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import json
import statistics
from pathlib import Path

from mtplx_ext import benchmark
from mtplx_ext.benchmark.harness import combined_runs, engine_run, prompt_groups
from mtplx_ext.models.packed_linear import unpack_cpu_linears
from mtplx_ext.shipped import SHIPPED_MODEL
from mtplx_ext.benchmark.provenance import provenance

LAYOUTS = ("packed", "row-major")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--depth", default="2,3,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    settings = [0] + [int(d) for d in args.depth.split(",")]  # 0: plain decoding
    models = {"packed": mtplx_ext.load(args.model), "row-major": mtplx_ext.load(args.model)}
    if not models["packed"].linears_packed:
        raise SystemExit("this CPU or model packs no Linear layer: nothing to compare")
    unpack_cpu_linears(models["row-major"])
    prompts = benchmark.heldout_prompts(models["packed"].tokenizer, args.prompts, args.prompt_tokens)
    rates: dict[tuple, list[float]] = {}
    outputs: dict[tuple, list] = {}
    for rep in range(args.repeats + 1):  # round 0 warms up (compiles, calibrates nothing: fixed depths)
        for b in batches:
            for k in settings:
                for layout in LAYOUTS:
                    runs = [engine_run(models[layout], g, args.tokens, mtp=k > 0, depth=max(k, 1))
                            for g in prompt_groups(prompts, b)]
                    run = combined_runs(runs)
                    outputs[layout, b, k] = run.outputs
                    if rep:
                        rates.setdefault((layout, b, k), []).append(run.tokens_per_s)
    med = {key: statistics.median(v) for key, v in rates.items()}
    print(f"{args.prompts} held-out prompts of {args.prompt_tokens} tokens, {args.tokens} new tokens, greedy, "
          f"medians of {args.repeats} interleaved rounds")
    print("| batch | depth | packed tokens/s | row-major tokens/s | packed / row-major | packed x plain | "
          "row-major x plain | same tokens |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for b in batches:
        for k in settings:
            p, r = med["packed", b, k], med["row-major", b, k]
            same = outputs["packed", b, k] == outputs["row-major", b, k]
            print(f"| {b} | {k or 'plain'} | {p:.1f} | {r:.1f} | {p / r:.2f} | {p / med['packed', b, 0]:.2f} | "
                  f"{r / med['row-major', b, 0]:.2f} | {'yes' if same else 'no (float rounding)'} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "python bench/scripts/packed_linear.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k not in ("model", "json")),
            "versions": benchmark.versions(),
            "tokens_per_s": {f"{layout}|{b}|{k}": med[layout, b, k] for layout in LAYOUTS for b in batches for k in settings},
            "provenance": provenance([args.model]),
        }, indent=1))


if __name__ == "__main__":
    main()
