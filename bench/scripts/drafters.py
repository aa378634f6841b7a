"""One MTP layer drafting K tokens: applied recursively, or run as K sequential depths, side by side.

The shipped head was fine-tuned with `train --depth`, whose objective runs
the head over the whole window again on its own output states (depth k at t
sees depth k - 1's state at t and the token at t + k): the sequential
scheme of checkpoints with several MTP layers (`engine.drafter.ModuleChain`).
Decoding drafts with the cheaper recursive scheme (`engine.drafter.Recursive`:
each chained step at the next position of the one KV cache, K head calls a
cycle against 2K - 1). This measures what the mismatch costs: the same
layer given as every depth of a `ModuleChain` (the runtime below lists it
twice) against the recursive drafter, greedy, held-out prompts, one batch,
interleaved per repeat; acceptance per draft position and tokens/s medians.

Run: python bench/scripts/drafters.py [--batch 8] [--depth 1,2,3,4] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import statistics

from mtp_layers import mean_accepted_length, per_depth, side_by_side

from mtplx_ext import _blas
from mtplx_ext.models.runtime import MTPRuntime
from mtplx_ext.shipped import SHIPPED_MODEL
from mtplx_ext import benchmark


def sequential_view(rt: MTPRuntime) -> MTPRuntime:
    """The same weights, with the one MTP layer listed twice: drafts go through `ModuleChain`."""
    view = MTPRuntime(rt.trunk, rt.head, rt.config, rt.tokenizer, more_modules=[rt.head])
    object.__setattr__(view, "_cpu_ops_fused", rt.cpu_ops_fused)
    return view


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", default="1,2,3,4")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rt = mtplx_ext.load(args.model)
    runtimes = {"recursive": rt, "sequential": sequential_view(rt)}
    prompts = benchmark.heldout_prompts(rt.tokenizer, args.batch, 48, seed=0)
    depths = [int(d) for d in args.depth.split(",")]
    runs = side_by_side(runtimes, [prompts], depths, args.tokens, args.repeats)
    print(f"BLAS: {_blas.describe()}; {args.batch} held-out prompts as one batch, {args.tokens} new tokens, greedy, "
          f"medians of {args.repeats} interleaved repeats")
    print("| depth | drafter | head calls / cycle | tokens/s | acceptance per depth | mean accepted length | same tokens |")
    print("|---:|---|---:|---:|---|---:|---|")
    for d in depths:
        base = runs[(d, "recursive")][0].outputs
        for name in runtimes:
            rs = runs[(d, name)]
            tps = statistics.median(r.tokens_per_s for r in rs)
            same = sum(a == b for a, b in zip(rs[0].outputs, base))
            calls = d if name == "recursive" else 2 * d - 1
            print(f"| {d} | {name} | {calls} | {tps:.1f} | {per_depth(rs[0])} | {mean_accepted_length(rs[0]):.3f} "
                  f"| {same}/{len(base)} |")


if __name__ == "__main__":
    main()
