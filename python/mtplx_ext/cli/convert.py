"""`mtplx-ext convert`: a Hugging Face checkpoint to an MLX folder that keeps the MTP head."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mtplx_ext.checkpoints import convert, convert_assistant, load
from mtplx_ext.cli.common import CLIError


def add_parser(sub: Any) -> None:
    """Adds the `convert` verb to the dispatcher's subparsers."""
    c = sub.add_parser(
        "convert",
        help="Hugging Face checkpoint -> MLX folder that keeps the MTP head",
        usage="mtplx-ext convert HF_FOLDER OUT [options]  |  mtplx-ext convert --mtp-from HF_FOLDER MLX_FOLDER OUT"
        "  |  mtplx-ext convert --drafter HF_ASSISTANT TARGET_FOLDER OUT [-q ...]",
    )
    c.add_argument("paths", nargs=2, metavar="FOLDER",
                   help="HF_FOLDER OUT, or with --mtp-from: MLX_FOLDER OUT, or with --drafter: TARGET_FOLDER OUT")
    c.add_argument("--drafter", metavar="HF_ASSISTANT",
                   help="convert this Gemma 4 assistant (checked against TARGET_FOLDER) into OUT")
    c.add_argument("--mtp-from", metavar="HF_FOLDER", help="add this checkpoint's MTP head to the MLX folder")
    c.add_argument("-q", "--quantize", action="store_true", help="quantize (mlx-lm's affine quantization)")
    c.add_argument("--q-bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=4)
    c.add_argument("--q-group-size", type=int, choices=(32, 64, 128), default=64)
    c.add_argument("--mtp-bits", choices=("2", "3", "4", "5", "6", "8", "float"),
                   help="the head's bits (default: the trunk's; float: keep the head unquantized)")
    c.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="float weights' dtype (default: the config's torch_dtype, else as stored)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    if args.mtp_from and (args.quantize or args.dtype):
        raise CLIError("--mtp-from matches the MLX folder's quantization and dtype; -q and --dtype do not apply")
    if args.drafter:
        return _convert_drafter(args)
    mtp_bits = ... if args.mtp_bits is None else (None if args.mtp_bits == "float" else int(args.mtp_bits))
    try:
        if args.mtp_from:
            mlx_folder, out = args.paths
            s = convert.add_mtp(args.mtp_from, mlx_folder, out, mtp_bits=mtp_bits, progress=not args.no_progress)
        else:
            hf_folder, out = args.paths
            s = convert.convert(
                hf_folder, out, quantize=args.quantize, q_bits=args.q_bits, q_group_size=args.q_group_size,
                mtp_bits=mtp_bits, dtype=args.dtype, progress=not args.no_progress,
            )
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise CLIError(str(e)) from e
    print(
        f"wrote {out}: {s['layout']} MTP head ({s['head_tensors']} tensors), "
        f"{s['bits_per_weight']:.2f} bits per weight, {s['bytes'] / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    return 0


def _convert_drafter(args: argparse.Namespace) -> int:
    if args.mtp_from or args.mtp_bits or args.dtype:
        raise CLIError("--drafter converts an assistant folder; --mtp-from, --mtp-bits and --dtype do not apply")
    target, out = args.paths
    q = {"bits": args.q_bits, "group_size": args.q_group_size} if args.quantize else None
    try:
        convert_assistant(args.drafter, out, quantize=q, target=load(target, fuse_cpu_ops=False))
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise CLIError(str(e)) from e
    how = f"{args.q_bits}-bit, group {args.q_group_size}" if q else "unquantized"
    print(f"wrote {out}: Gemma 4 assistant drafter ({how})", file=sys.stderr)
    return 0
