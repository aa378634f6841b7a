"""`mtplx-ext grow`: a function-preserving, memory-bound-sized copy of a model (the performance benchmark's)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mtplx_ext.checkpoints import grow as growth
from mtplx_ext.cli.common import CLIError
from mtplx_ext.shipped import SHIPPED_MODEL


def add_parser(sub: Any) -> None:
    """Adds the `grow` verb: OUT, --width, --depth, --from, --dtype, --shard-mb."""
    p = sub.add_parser("grow", help="grow a qwen3 + MTP model wider and deeper, same logits (a memory-bound benchmark model)")
    p.add_argument("out", metavar="OUT", help="model folder to create (must not exist or be empty)")
    p.add_argument("--width", type=int, default=8, help="factor of the hidden, attention-head and MLP widths (default 8)")
    p.add_argument("--depth", type=int, default=2, help="factor of the trunk's layer count (default 2)")
    p.add_argument("--from", dest="src", default=None,
                   help="qwen3 model folder with a qwen3_next head to grow (default: the shipped model)")
    p.add_argument("--dtype", default="float32", choices=tuple(growth.DTYPES), help="storage dtype (default float32)")
    p.add_argument("--shard-mb", type=float, default=growth.DEFAULT_SHARD_BYTES / 2**20,
                   help="most MiB per trunk shard, about the peak memory (default 512)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Grows the model `args` describe and says what it wrote."""
    src = Path(args.src) if args.src else SHIPPED_MODEL
    t0 = time.perf_counter()
    try:
        out = growth.grow(src, args.out, width=args.width, depth=args.depth, dtype=args.dtype,
                          shard_bytes=int(args.shard_mb * 2**20))
    except (ValueError, TypeError, OSError) as e:
        raise CLIError(str(e)) from e
    config = json.loads((out / "config.json").read_text())
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
          f"{size / 1e9:.3f} GB of weights in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
