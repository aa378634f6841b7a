"""Model folders side by side: held-out acceptance per draft position and tokens/s, by depth.

Made for heads with one vs several MTP layers fine-tuned the same way, e.g.
(the trunk frozen, the same budget and seed; `--mtp-layers 2` starts layer 1
as a copy of the shipped layer):

    python -m mtplx_ext.train --init python/mtplx_ext/assets/tiny-qwen3-mtp --freeze-trunk 1 --depth 2 \\
        --minutes 12 --batch 8 --lr 1e-3 --warmup 20 --seed 1 --distill 0.7 --mtp-layers 1 --out /tmp/one
    (the same with --mtp-layers 2 --out /tmp/two)
    python bench/mtp_layers.py python/mtplx_ext/assets/tiny-qwen3-mtp /tmp/one /tmp/two

Greedy, `--prompts` held-out prompts decoded `--batch` at a time, compiled;
acceptance and mean accepted length over all of them; tokens/s the median of
`--repeats` interleaved passes after a warm-up.
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import statistics

from mtplx_ext import _blas, cli


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
    prompts = cli.heldout_prompts(next(iter(rts.values())).tokenizer, args.prompts, 48, seed=0)
    groups = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    depths = [int(d) for d in args.depth.split(",")]
    runs: dict[tuple[int, str], list[list]] = {(d, m): [] for d in depths for m in rts}
    for rep in range(args.repeats + 1):  # the first pass warms traces and kernels up
        for d in depths:
            for m, rt in rts.items():
                res = [mtplx_ext.generate_greedy_batched(rt, g, max_new_tokens=args.tokens, depth=d) for g in groups]
                if rep:
                    runs[(d, m)].append(res)
    print(f"BLAS: {_blas.describe()}; {args.prompts} held-out prompts, {args.batch} per batch, {args.tokens} new "
          f"tokens, greedy, tokens/s medians of {args.repeats} interleaved passes")
    print("| depth | model | MTP layers | acceptance per depth | mean accepted length | tokens/s |")
    print("|---:|---|---:|---|---:|---:|")
    for d in depths:
        for m, rt in rts.items():
            res = runs[(d, m)][0]
            per = "/".join(
                f"{sum(r.accepted_at[j] for r in res) / max(1, sum(r.reached[j] for r in res)):.3f}" for j in range(d)
            )
            L = sum(r.accepted for r in res) / max(1, sum(r.stream_cycles for r in res))
            tps = statistics.median(
                sum(len(s.tokens) for r in rs for s in r.streams) / sum(r.decode_s for r in rs) for rs in runs[(d, m)]
            )
            print(f"| {d} | {m} | {len(rt.mtp_modules)} | {per} | {L:.3f} | {tps:.1f} |")


if __name__ == "__main__":
    main()
