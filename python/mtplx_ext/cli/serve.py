"""`mtplx-ext serve`: the OpenAI-compatible server with continuous MTP batching."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

from mtplx_ext.cli import common, parallel
from mtplx_ext.cli.common import CLIError, depth_flag, positive
from mtplx_ext.serve import limits
from mtplx_ext.shipped import SHIPPED_MODEL


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """--prefix-cache-disk-bytes: bytes, or a number with K, M, G or T (powers of 1024; "B" / "iB" may follow)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        v = float(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prefix-cache-disk-bytes must be a size like 4G or 500M, got {text!r}") from None
    if not 0 <= v < 1 << 60:
        raise argparse.ArgumentTypeError(f"--prefix-cache-disk-bytes must be >= 0, got {text!r}")
    return int(v)


def add_parser(sub: Any) -> None:
    """Adds the `serve` verb to the dispatcher's subparsers."""
    s = sub.add_parser("serve", help="OpenAI-compatible server with continuous MTP batching")
    s.add_argument("--model", help="model folder (default: the shipped model)")
    s.add_argument("--drafter", metavar="FOLDER", help="a Gemma 4 assistant folder drafting for --model")
    common.add_kv_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--max-batch", type=positive("--max-batch"), default=limits.DEFAULT_MAX_BATCH,
                   help="most streams decoding at once")
    s.add_argument("--depth", type=depth_flag, default="auto",
                   help="MTP drafts per cycle, 1..8, or auto (default: the fastest for a full batch here; plain where MTP would not pay)")
    common.add_recalibrate_flag(s)
    s.add_argument("--no-mtp", action="store_true", help="plain autoregressive decoding (the baseline)")
    s.add_argument("--max-kv-slots", type=positive("--max-kv-slots"), help="most KV slots of the running batch")
    s.add_argument("--prefill-chunk", type=positive("--prefill-chunk"), default=limits.DEFAULT_PREFILL_CHUNK)
    s.add_argument("--prefix-cache-mb", type=int, default=limits.DEFAULT_PREFIX_CACHE_MB,
                   help="MiB of prompt KV kept for later prompts that start alike (0: off)")
    s.add_argument("--prefix-cache-dir", metavar="DIR",
                   help="also keep the prefix cache's blocks in DIR, across restarts (default: RAM only)")
    s.add_argument("--prefix-cache-disk-bytes", type=byte_size, default=limits.DEFAULT_PREFIX_CACHE_DISK_BYTES,
                   metavar="SIZE", help="most bytes of files in --prefix-cache-dir, e.g. 4G or 500M (default 4G)")
    s.add_argument("--api-key", help="require Authorization: Bearer KEY")
    s.add_argument("--shutdown-grace", type=float, default=limits.DEFAULT_SHUTDOWN_GRACE_S,
                   help="seconds requests in flight get to finish after SIGINT / SIGTERM before they are ended "
                        "(default %(default)g)")
    s.add_argument("--max-body-mb", type=float, default=limits.DEFAULT_MAX_BODY_BYTES / (1 << 20),
                   help="largest request body in MiB; larger ones get a 413 (default %(default)g)")
    s.add_argument("--reasoning-markers", default="auto", metavar="auto|none|START,END",
                   help="the model's reasoning markers, split off the reply as reasoning_content / thinking blocks: "
                        "found from the tokenizer and chat template (auto), none, or named (default %(default)s)")
    parallel.add_flags(s)
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`mtplx-ext serve`: loads the model and serves it until SIGINT / SIGTERM, then ends the process (status 0)."""
    from mtplx_ext.serve import serve  # noqa: PLC0415  (starlette, uvicorn: the serve extra)
    from mtplx_ext.serve.server import bind  # noqa: PLC0415

    if args.prefix_cache_mb < 0:
        raise CLIError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if not 0 <= args.port < 65536:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.shutdown_grace <= 3600:
        raise CLIError(f"--shutdown-grace must be in [0, 3600] seconds, got {args.shutdown_grace}")
    if not 0 < args.max_body_mb <= 1024:
        raise CLIError(f"--max-body-mb must be in (0, 1024], got {args.max_body_mb}")
    if args.reasoning_markers not in ("auto", "none") and not all(args.reasoning_markers.partition(",")[::2]):
        raise CLIError(f"--reasoning-markers must be auto, none or START,END, got {args.reasoning_markers!r}")
    common.apply_recalibrate(args)
    dist = parallel.start(args)  # rank 0 answers HTTP; the others step its engine in lockstep
    sock = None
    if dist is None or dist.group.rank() == 0:
        # The address first: a taken port is a one-line error before the model loads.
        try:
            sock = bind(args.host, args.port)
        except OSError as e:
            raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    try:
        rt = common.load_model(args.model, need_mtp=not args.no_mtp, drafter=args.drafter,
                               **parallel.load_kwargs(dist), kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
        folder = Path(args.model) if args.model else SHIPPED_MODEL
        if args.depth == "auto" and not args.no_mtp:
            print(f"mtplx-ext serve: --depth auto, {common.calibration_note(rt)}", file=sys.stderr, flush=True)
            parallel.agree_depth(dist, rt, [args.max_batch])
        # What lives as long as the process (imports, the model, its tokenizer) leaves the collector's
        # view: a full collection would otherwise scan it again and again, a pause in every stream.
        gc.freeze()
        serve(rt, folder, max_batch=args.max_batch, depth=args.depth, use_mtp=not args.no_mtp,
              api_key=args.api_key, max_kv_slots=args.max_kv_slots, prefill_chunk=args.prefill_chunk,
              prefix_cache_bytes=args.prefix_cache_mb << 20, prefix_cache_dir=args.prefix_cache_dir,
              prefix_cache_disk_bytes=args.prefix_cache_disk_bytes, sock=sock, shutdown_grace=args.shutdown_grace,
              max_body_bytes=int(args.max_body_mb * (1 << 20)), reasoning_markers=args.reasoning_markers,
              group=None if dist is None else dist.group, watchdog=None if dist is None else dist.watchdog)
    except ValueError as e:
        raise CLIError(str(e)) from e
    finally:
        if sock is not None:
            sock.close()
    # The server is down and the engine stopped: only the interpreter's own
    # teardown is left, and with torch loaded (transformers imports it) that
    # alone takes most of a second, which the shutdown's bound should not
    # include. Nothing else is left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
