"""The `mtplx-ext` command: a small dispatcher over one module per verb.

    mtplx-ext generate "def parse(" --max-tokens 64
    mtplx-ext bench --batch 1,8 --tokens 128 --repeats 3 --json bench.json
    mtplx-ext convert HF_FOLDER OUT -q
    mtplx-ext serve --port 8080
    mtplx-ext grow /tmp/grown --width 8 --depth 2

Without --model the verbs use the small model shipped inside the package.
Each verb module (`generate`, `bench`, `convert`, `grow`, `serve`) has
`add_parser(subparsers)` and `run(args) -> exit status`; shared pieces are in
`common`.
"""

from __future__ import annotations

import argparse
import sys

from mtplx_ext.cli import bench, convert, generate, grow, serve
from mtplx_ext.cli.common import CLIError, StdoutError, drop_stdout

VERBS = (generate, bench, convert, grow, serve)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtplx-ext", description="Batched MTP speculative decoding on MLX.")
    sub = p.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        verb.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs `mtplx-ext`; returns the exit status.

    0 on success; 2 for a user error (one line on stderr: bad flags, model
    folders, prompts, an unwritable output); 130 on Ctrl-C; 141 (as for a
    process ended by SIGPIPE) without a message when the reader of stdout
    goes away, as in `mtplx-ext generate ... | head`.
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except BrokenPipeError:
        drop_stdout()
        return 141
    except CLIError as e:
        if isinstance(e, StdoutError):
            drop_stdout()
        print(f"mtplx-ext: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmtplx-ext: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
