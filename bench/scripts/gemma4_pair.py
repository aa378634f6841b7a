"""A Gemma 4 target with its assistant: held-out acceptance by depth and MTP vs plain tokens/s.

For a pair trained by `mtplx_ext.train.gemma4` (or any `gemma4_text` target
and `gemma4_assistant` folder that load together):

    python -m mtplx_ext.train.gemma4 target --out PAIR/target --minutes 12
    python -m mtplx_ext.train.gemma4 assistant --target PAIR/target --out PAIR/assistant --minutes 8
    python bench/scripts/gemma4_pair.py PAIR/target PAIR/assistant --json bench/results/gemma4_pair.json

It is `mtplx-ext bench --model TARGET --drafter ASSISTANT --heldout N`
(`mtplx_ext.benchmark.run_bench`: greedy, compiled, MTP at each depth, the
engine's plain decoding and mlx-lm's own generation of the target, interleaved
per repeat, medians of repeats and of per-repeat ratios) with prompts cut
from the held-out stdlib files (the split both stages held out), longer
than the target's sliding window by default, plus a side-by-side summary: per
depth and batch, mean accepted drafts per cycle, acceptance by draft
position, MTP and plain tokens/s. The JSON holds the full report and the
pair's training summaries.

Run: python bench/scripts/gemma4_pair.py TARGET ASSISTANT [--batch 1,8] [--depth 1,2,3] [--tokens 128]
     [--prompts 8] [--prompt-tokens 64] [--repeats 3] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mtplx_ext import benchmark
from mtplx_ext.benchmark.provenance import provenance


def summary_table(report: dict) -> str:
    """Per depth and batch: mean accepted drafts per cycle, acceptance by position, MTP vs plain tokens/s."""
    rows = report["rows"]
    plain = {r["batch"]: r for r in rows if r["method"] == "plain"}
    lines = [
        "| depth | batch | mean accepted drafts / cycle | acceptance by draft position | MTP tokens/s "
        "| plain tokens/s | x plain | same tokens as plain |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    mtp = sorted((r for r in rows if r["method"].startswith("mtp")), key=lambda r: (r["depth"], r["batch"]))
    for r in mtp:
        p = plain[r["batch"]]
        per = "/".join(f"{a:.2f}" for a in r["acceptance_per_depth"])
        lines.append(
            f"| {'/'.join(map(str, r['depth']))} | {r['batch']} | {r['mean_accepted_length']:.2f} | {per} | "
            f"{r['tokens_per_s']:.1f} | {p['tokens_per_s']:.1f} | {r['ratio_to_plain']:.2f} | "
            f"{r['streams_equal_to_plain']}/{r['streams']} |"
        )
    return "\n".join(lines)


def training(folder: Path) -> dict[str, Any] | None:
    """The folder's train_summary.json without its copy of the target's (None when absent)."""
    f = folder / "train_summary.json"
    if not f.is_file():
        return None
    s = json.loads(f.read_text())
    s.pop("target", None)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path, help="gemma4_text target folder")
    ap.add_argument("assistant", type=Path, help="gemma4_assistant folder drafting for it")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--depth", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="where the held-out prompts are cut")
    ap.add_argument("--json")
    args = ap.parse_args()
    rt = mtplx_ext.load(args.target, drafter=args.assistant)
    if rt.tokenizer is None:
        ap.error(f"{args.target} has no tokenizer.json")
    window = int(rt.trunk.args.sliding_window)
    if args.prompt_tokens <= window:
        print(f"note: prompts of {args.prompt_tokens} tokens do not go past the sliding window ({window})",
              file=sys.stderr)
    prompts = benchmark.heldout_prompts(rt.tokenizer, args.prompts, args.prompt_tokens, seed=args.seed)
    batches = [int(b) for b in args.batch.split(",")]
    depths = [int(d) for d in args.depth.split(",")]
    report = benchmark.run_bench(
        rt, rt.tokenizer, batches, args.tokens, args.repeats, baseline=benchmark.mlx_lm_model(args.target),
        depths=depths, prompt_ids=prompts,
    )
    report["command"] = "python bench/scripts/gemma4_pair.py " + " ".join(sys.argv[1:])
    report["pair"] = {"target": str(args.target), "assistant": str(args.assistant), "sliding_window": window,
                      "prompt_tokens": args.prompt_tokens,
                      "target_training": training(args.target), "assistant_training": training(args.assistant)}
    print(f"{args.prompts} held-out prompts of {args.prompt_tokens} tokens (sliding window {window}), "
          f"{args.tokens} new tokens, greedy")
    print(benchmark.format_table(report))
    print()
    print(summary_table(report))
    if args.json:
        report["provenance"] = provenance([args.target, args.assistant])
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
