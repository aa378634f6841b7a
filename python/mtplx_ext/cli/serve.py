"""`mtplx-ext serve`: the OpenAI-compatible server with continuous MTP batching."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mtplx_ext.cli import common
from mtplx_ext.cli.common import CLIError, depth_flag, positive
from mtplx_ext.shipped import SHIPPED_MODEL


def add_parser(sub: Any) -> None:
    """Adds the `serve` verb to the dispatcher's subparsers."""
    s = sub.add_parser("serve", help="OpenAI-compatible server with continuous MTP batching")
    s.add_argument("--model", help="model folder (default: the shipped model)")
    s.add_argument("--drafter", metavar="FOLDER", help="a Gemma 4 assistant folder drafting for --model")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--max-batch", type=positive("--max-batch"), default=8, help="most streams decoding at once")
    s.add_argument("--depth", type=depth_flag, default="auto",
                   help="MTP drafts per cycle, 1..8, or auto (default: the fastest for a full batch here; plain where MTP would not pay)")
    s.add_argument("--no-mtp", action="store_true", help="plain autoregressive decoding (the baseline)")
    s.add_argument("--max-kv-slots", type=positive("--max-kv-slots"), help="most KV slots of the running batch")
    s.add_argument("--prefill-chunk", type=positive("--prefill-chunk"), default=256)
    s.add_argument("--prefix-cache-mb", type=int, default=256,
                   help="MiB of prompt KV kept for later prompts that start alike (0: off)")
    s.add_argument("--api-key", help="require Authorization: Bearer KEY")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`mtplx-ext serve`: loads the model and serves it until SIGINT / SIGTERM."""
    from mtplx_ext.serve import serve  # noqa: PLC0415  (starlette, uvicorn: the serve extra)

    if args.prefix_cache_mb < 0:
        raise CLIError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if not 0 <= args.port < 65536:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    rt = common.load_model(args.model, need_mtp=not args.no_mtp, drafter=args.drafter)
    folder = Path(args.model) if args.model else SHIPPED_MODEL
    try:
        serve(rt, folder, host=args.host, port=args.port, max_batch=args.max_batch, depth=args.depth,
              use_mtp=not args.no_mtp, api_key=args.api_key, max_kv_slots=args.max_kv_slots,
              prefill_chunk=args.prefill_chunk, prefix_cache_bytes=args.prefix_cache_mb << 20)
    except ValueError as e:
        raise CLIError(str(e)) from e
    return 0
