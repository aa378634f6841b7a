"""Model folders side by side: held-out acceptance per draft position and tokens/s, by depth.

Made for heads with one vs several MTP layers fine-tuned the same way, e.g.
(the trunk frozen, the same budget and seed; `--mtp-layers 2` starts layer 1
as a copy of the shipped layer):

    python -m mtplx_ext.train --init python/mtplx_ext/assets/tiny-qwen3-mtp --freeze-trunk 1 --depth 2 \\
        --minutes 12 --batch 8 --lr 1e-3 --warmup 20 --seed 1 --distill 0.7 --mtp-layers 1 --out /tmp/one
    (the same with --mtp-layers 2 --out /tmp/two)
    python bench/scripts/mtp_layers.py python/mtplx_ext/assets/tiny-qwen3-mtp /tmp/one /tmp/two

Greedy, `--prompts` held-out prompts decoded `--batch` at a time, compiled;
acceptance and mean accepted length over all of them; tokens/s the median of
`--repeats` interleaved passes after a warm-up.
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import statistics
from typing import Any

from mtplx_ext import _blas
from mtplx_ext import benchmark


def side_by_side(
    runtimes: dict[str, Any], groups: list[list[list[int]]], depths: list[int], tokens: int, repeats: int
) -> dict[tuple[int, str], list[benchmark.Run]]:
    """Greedy decodes of every prompt group, per (depth, runtime), interleaved; one combined Run per pass.

    The first pass warms traces and kernels up and is dropped.
    """
    runs: dict[tuple[int, str], list[benchmark.Run]] = {(d, name): [] for d in depths for name in runtimes}
    for rep in range(repeats + 1):
        for d in depths:
            for name, rt in runtimes.items():
                run = benchmark.combined_runs([benchmark.engine_run(rt, g, tokens, True, depth=d) for g in groups])
                if rep:
                    runs[(d, name)].append(run)
    return runs


def per_depth(run: benchmark.Run) -> str:
    """Acceptance at each draft position, as a/b/c."""
    return "/".join(f"{a / max(1, n):.3f}" for a, n in zip(run.accepted_at, run.reached))


def mean_accepted_length(run: benchmark.Run) -> float:
    return run.accepted / max(1, run.stream_cycles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rts = {m: mtplx_ext.load(m) for m in args.models}
    prompts = benchmark.heldout_prompts(next(iter(rts.values())).tokenizer, args.prompts, 48, seed=0)
    depths = [int(d) for d in args.depth.split(",")]
    runs = side_by_side(rts, benchmark.prompt_groups(prompts, args.batch), depths, args.tokens, args.repeats)
    print(f"BLAS: {_blas.describe()}; {args.prompts} held-out prompts, {args.batch} per batch, {args.tokens} new "
          f"tokens, greedy, tokens/s medians of {args.repeats} interleaved passes")
    print("| depth | model | MTP layers | acceptance per depth | mean accepted length | tokens/s |")
    print("|---:|---|---:|---|---:|---:|")
    for d in depths:
        for m, rt in rts.items():
            rs = runs[(d, m)]
            tps = statistics.median(r.tokens_per_s for r in rs)
            print(f"| {d} | {m} | {len(rt.mtp_modules)} | {per_depth(rs[0])} | {mean_accepted_length(rs[0]):.3f} "
                  f"| {tps:.1f} |")


if __name__ == "__main__":
    main()
