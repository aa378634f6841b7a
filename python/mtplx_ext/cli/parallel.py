"""`--tensor-parallel` / `--pipeline-parallel`: one model across the ranks of `mlx.launch`.

    mlx.launch -n 2 --backend ring -- mtplx-ext generate --tensor-parallel "def parse("

Each rank loads its part (`checkpoints.sharded`), the ranks compare the
model folder and every flag before anything else (`collective.check_launch`:
a difference is refused naming it), "auto" depths are calibrated on every
rank alike, and the decode runs identically everywhere; rank 0 prints what
one process prints, the others nothing. A `Watchdog` ends a rank whose
peers stopped answering for `--dist-timeout` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtplx_ext.batching import collective
from mtplx_ext.cli.common import CLIError
from mtplx_ext.shipped import SHIPPED_MODEL


def add_flags(p: argparse.ArgumentParser) -> None:
    """The distributed flags of a verb (`generate`, `bench`, `serve`)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tensor-parallel", action="store_true",
                   help="split every layer across the ranks of mlx.launch (mlx-lm's shard())")
    g.add_argument("--pipeline-parallel", action="store_true",
                   help="split the layers into one stage per rank of mlx.launch (mlx-lm's pipeline())")
    p.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds without an answer from the other ranks before a rank exits (default 300)")
    p.add_argument("--dist-check-every", type=int, default=0,
                   help="compare the ranks' committed tokens every N commits (0: at the end only)")


@dataclass
class Dist:
    """A distributed run: its group, this rank, and its guards."""

    group: Any
    parallel: str
    watchdog: collective.Watchdog
    agreement: collective.Agreement

    @property
    def rank(self) -> int:
        return self.group.rank()


def start(args: argparse.Namespace) -> Dist | None:
    """Joins the run when a parallel flag is given (None otherwise); silences ranks > 0, checks the launch.

    Raises:
        CLIError: a bad flag value, or ranks launched with different flags or model folders.
    """
    if not (getattr(args, "tensor_parallel", False) or getattr(args, "pipeline_parallel", False)):
        return None
    if not args.dist_timeout > 0:
        raise CLIError(f"--dist-timeout must be > 0, got {args.dist_timeout}")
    if args.dist_check_every < 0:
        raise CLIError(f"--dist-check-every must be >= 0, got {args.dist_check_every}")
    group = mx.distributed.init()
    collective.silence_other_ranks(group)
    dist = Dist(group, "tensor" if args.tensor_parallel else "pipeline",
                collective.Watchdog(args.dist_timeout, group.rank()),
                collective.Agreement(group, args.dist_check_every))
    flags = {f"--{k.replace('_', '-')}": v for k, v in vars(args).items() if k not in ("func", "argv")}
    fields = {**collective.folder_fields(args.model or SHIPPED_MODEL), **flags}
    try:
        collective.check_launch(group, fields)
    except collective.DistributedError as e:
        raise CLIError(str(e)) from None
    dist.watchdog.beat()
    return dist


def load_kwargs(dist: Dist | None) -> dict[str, Any]:
    """`common.load_model`'s arguments for this run."""
    return {} if dist is None else {"group": dist.group, "parallel": dist.parallel}


def agree_depth(dist: Dist | None, rt: Any, batches: Sequence[int], enforce_eager: bool = False) -> None:
    """Makes "auto" pick the same depth on every rank at these batch sizes (calibrating on all of them)."""
    if dist is not None:
        collective.agree_auto_depth(dist.group, rt, batches, enforce_eager)
        dist.watchdog.beat()


def on_commit(dist: Dist | None, inner: Callable[[int, list[int]], None] | None) -> Callable | None:
    """A commit callback that also beats the watchdog and feeds the agreement hash."""
    if dist is None:
        return inner

    def hook(i: int, new: list[int]) -> None:
        dist.watchdog.beat()
        dist.agreement.update(i, new)
        if inner is not None:
            inner(i, new)

    return hook


@contextlib.contextmanager
def guard(dist: Dist | None) -> Iterator[None]:
    """Turns the ranks' disagreement or a lost peer into a one-line CLIError (non-zero exit)."""
    try:
        yield
    except collective.DistributedError as e:
        raise CLIError(str(e)) from None
    except RuntimeError as e:
        if dist is None or not collective.is_transport_error(e):
            raise
        raise CLIError(collective.lost_peer_message(dist.rank, e)) from None


def finish(dist: Dist | None) -> None:
    """The end of a decode: the ranks compare their committed tokens.

    Raises:
        CLIError: the ranks committed different tokens.
    """
    if dist is None:
        return
    try:
        dist.agreement.check()
    except collective.DistributedError as e:
        raise CLIError(str(e)) from None
    dist.watchdog.beat()


__all__ = ["Dist", "add_flags", "agree_depth", "finish", "guard", "load_kwargs", "on_commit", "start"]
