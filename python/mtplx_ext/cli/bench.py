"""`mtplx-ext bench`: MTP vs plain decoding vs mlx-lm, tokens/s, interleaved repeats."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mtplx_ext import _blas
from mtplx_ext.benchmark import format_table, heldout_prompts, mlx_lm_model, run_bench, write_plot
from mtplx_ext.benchmark.provenance import provenance
from mtplx_ext.cli import common, parallel
from mtplx_ext.cli.common import (
    Stdout,
    check_writable,
    depths_flag,
    parse_batches,
    positive,
    seed_flag,
    tokenizer,
)
from mtplx_ext.decode import autodepth
from mtplx_ext.shipped import SHIPPED_MODEL


def add_parser(sub: Any) -> None:
    """Adds the `bench` verb to the dispatcher's subparsers."""
    b = sub.add_parser("bench", help="MTP vs plain decoding vs mlx-lm, tokens/s")
    b.add_argument("--model", help="model folder (default: the shipped model)")
    b.add_argument("--drafter", metavar="FOLDER", help="a Gemma 4 assistant folder drafting for --model")
    common.add_kv_flags(b)
    b.add_argument(
        "--batch",
        type=parse_batches,
        default=[1, 4, 8],
        help="batch sizes, e.g. 1,4,8 (each decodes all 8 bench prompts, b at a time)",
    )
    b.add_argument("--tokens", type=positive("--tokens"), default=128, help="new tokens per stream")
    b.add_argument("--depth", type=depths_flag, default=["auto"],
                   help="MTP depths to sweep, e.g. 1,2,3,4,5,auto (default auto: the fastest depth here)")
    common.add_recalibrate_flag(b)
    b.add_argument(
        "--heldout", type=positive("--heldout"), default=0,
        help="N prompts cut at random from held-out Python stdlib files (not trained on) instead of the bench's own",
    )
    b.add_argument("--prompt-tokens", type=positive("--prompt-tokens"), default=48, help="tokens per held-out prompt")
    b.add_argument("--seed", type=seed_flag, default=0, help="where the held-out prompts are cut")
    b.add_argument("--repeats", type=positive("--repeats"), default=3)
    b.add_argument("--json", help="write the full report here")
    b.add_argument("--plot", help="write a bar chart PNG here (needs matplotlib)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--enforce-eager", action="store_true", help="the engine builds every step in Python (no mx.compile)")
    parallel.add_flags(b)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            check_writable(flag, path)
    common.apply_recalibrate(args)
    dist = parallel.start(args)  # before stdout is taken: ranks > 0 print nothing
    out = Stdout()
    rt = common.load_model(args.model, need_mtp=True, drafter=args.drafter, **parallel.load_kwargs(dist),
                           kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
    tok = tokenizer(rt, args.model)
    print(f"BLAS: {_blas.describe()}", file=sys.stderr)
    # Distributed, mlx-lm's own generation runs the sharded trunk (its collectives included).
    baseline = mlx_lm_model(Path(args.model) if args.model else SHIPPED_MODEL) if dist is None else None
    prompt_ids = heldout_prompts(tok, args.heldout, args.prompt_tokens, seed=args.seed) if args.heldout else None
    with parallel.guard(dist):
        if "auto" in args.depth:
            print(f"--depth auto: {common.calibration_note(rt)}", file=sys.stderr)
            parallel.agree_depth(dist, rt, args.batch, args.enforce_eager)
        report = run_bench(
            rt, tok, args.batch, args.tokens, args.repeats, progress=not args.no_progress, baseline=baseline,
            enforce_eager=args.enforce_eager, depths=args.depth, prompt_ids=prompt_ids,
        )
        parallel.finish(dist)
    report["command"] = "mtplx-ext " + " ".join(args.argv)
    if "auto" in args.depth:
        report["calibration_key"] = autodepth.calibration_key(rt)
    report["provenance"] = provenance([args.model, args.drafter] if args.drafter else [args.model])
    if dist is not None:
        report["distributed"] = {"parallel": dist.parallel, "ranks": dist.group.size()}
    report["model"] = str(Path(args.model).resolve()) if args.model else "shipped:" + SHIPPED_MODEL.name
    out.write(format_table(report) + "\n")
    out.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    if args.plot:
        print(write_plot(report, args.plot), file=sys.stderr)
    return 0
