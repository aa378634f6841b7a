"""What ranks of one distributed run share besides the model's own collectives.

Every rank of a tensor- or pipeline-parallel run (`checkpoints.sharded`)
executes the same decode: the same cycles on identical logits, the same
sampling keys, hence the same bundles and commits. That holds only while
the ranks agree, so this module gives the run three guards, all built on
`mx.distributed` collectives (no transport of its own):

* `check_launch`: at start, one `all_gather` of a hash per field (model
  config, weight files, each flag); ranks that differ are refused with the
  fields named, before anything decodes;
* `Agreement`: a running hash of the committed tokens, compared across
  ranks with one small `all_gather` every N commits and at the end;
* `Watchdog`: a rank whose peers die or stop answering blocks inside a
  collective that never completes; a thread watching the run's heartbeats
  writes one line to stderr and exits the process (status 3) after
  `timeout_s` without one.

`broadcast` sends rank 0's int32 array to every rank (an `all_sum` in
which the other ranks add zeros), `agree_auto_depth` makes `depth="auto"`
pick one K on all ranks (each rank times the same calibration decodes,
rank 0's timings decide).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext.decode import autodepth
from mtplx_ext.decode.generate import generate_greedy_reference

#: Exit status of a rank whose peers stopped answering.
WATCHDOG_EXIT = 3


class DistributedError(RuntimeError):
    """The ranks of a run disagree (launch or decode): one line naming what differs."""


#: How MLX's distributed backends word a failed transport (a peer that exited, a closed socket).
_TRANSPORT_MARKS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "peer")


def is_transport_error(e: BaseException) -> bool:
    """Whether an exception is MLX's distributed backend losing a peer (not a bug of ours)."""
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _TRANSPORT_MARKS)


def lost_peer_message(rank: int, e: BaseException) -> str:
    """The one line a rank prints when its peers are gone."""
    return f"rank {rank}: lost the connection to another rank ({str(e).strip() or type(e).__name__}); exiting"


def _crc(value: Any) -> int:
    text = json.dumps(value, sort_keys=True, default=str)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def all_gather_ints(group: Any, values: Sequence[int]) -> np.ndarray:
    """[ranks, len(values)] int64 array of every rank's `values` (int32 on the wire, 31-bit values)."""
    x = mx.array(np.asarray(values, dtype=np.int32).reshape(1, -1))
    out = mx.distributed.all_gather(x, group=group, stream=mx.cpu)
    return np.array(out).astype(np.int64).reshape(group.size(), -1)


def broadcast(group: Any, values: np.ndarray | None, size: int) -> np.ndarray:
    """Rank 0's int32 `values` ([size]) on every rank (others pass None)."""
    if group.rank() == 0:
        if values is None or values.shape != (size,):
            raise ValueError(f"broadcast: rank 0 must give {size} values")
        x = mx.array(values.astype(np.int32))
    else:
        x = mx.zeros((size,), dtype=mx.int32)
    return np.array(mx.distributed.all_sum(x, group=group, stream=mx.cpu))


def check_launch(group: Any, fields: Mapping[str, Any]) -> None:
    """Refuses a launch whose ranks differ in any of `fields` (name -> JSON-able value).

    Raises:
        DistributedError: naming every field some rank holds differently,
            on every rank (each sees the same gathered hashes).
    """
    names = sorted(fields)
    hashes = all_gather_ints(group, [_crc(fields[n]) for n in names])
    differ = [n for i, n in enumerate(names) if len(set(hashes[:, i].tolist())) > 1]
    if differ:
        raise DistributedError(
            f"the {group.size()} ranks disagree on {', '.join(differ)}: start every rank with the same "
            "command on the same model folder"
        )


def folder_fields(folder: Any) -> dict[str, Any]:
    """What ranks must share about a model folder: its config and its weight files' names and sizes."""
    from pathlib import Path  # noqa: PLC0415

    p = Path(folder)
    config = json.loads((p / "config.json").read_text()) if (p / "config.json").is_file() else None
    files = sorted((f.name, f.stat().st_size) for f in p.glob("*.safetensors"))
    return {"model config": config, "model weight files": files}


class Agreement:
    """A running hash of committed tokens, compared across ranks.

    Args:
        group: the run's group.
        every: compare after this many `update`s (0: only at `check`).
    """

    def __init__(self, group: Any, every: int = 0):
        self.group, self.every = group, int(every)
        self.crc = 0
        self.updates = 0
        self.checks = 0

    def update(self, stream: int, tokens: Sequence[int]) -> None:
        self.crc = zlib.crc32(np.asarray([stream, *tokens], dtype=np.int64).tobytes(), self.crc)
        self.updates += 1
        if self.every and self.updates % self.every == 0:
            self.check()

    def check(self) -> None:
        """One all_gather of the hash.

        Raises:
            DistributedError: the ranks committed different tokens.
        """
        got = all_gather_ints(self.group, [self.crc & 0x7FFFFFFF, self.updates & 0x7FFFFFFF])
        self.checks += 1
        if len({tuple(r) for r in got.tolist()}) > 1:
            raise DistributedError(
                f"the ranks committed different tokens by commit {self.updates} "
                f"(per-rank hash, commits: {got.tolist()})"
            )


class Watchdog:
    """Exits the process when no heartbeat came for `timeout_s` seconds.

    A collective whose peer died or hangs never returns (MLX's ring backend
    has no timeout), so the main thread cannot report it; this daemon thread
    can. The message goes to the process's stderr descriptor directly
    (non-zero ranks may have their Python-level output silenced).

    Args:
        timeout_s: seconds without `beat()` before exiting; must exceed the
            longest step between beats (a prefill, a calibration decode).
        rank: named in the message.
    """

    def __init__(self, timeout_s: float, rank: int):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s, self.rank = float(timeout_s), int(rank)
        self._last = time.monotonic()
        self._paused = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtplx-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def close(self) -> None:
        self._done.set()

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self) -> None:
        step = min(1.0, self.timeout_s / 4)
        while not self._done.wait(step):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                msg = (
                    f"mtplx-ext: error: rank {self.rank}: no answer from the other ranks for {idle:.0f} s "
                    "(a rank died or stopped answering); exiting\n"
                )
                try:
                    os.write(2, msg.encode())
                finally:
                    os._exit(WATCHDOG_EXIT)


def agree_auto_depth(group: Any, runtime: Any, batches: Sequence[int], enforce_eager: bool = False) -> dict[int, int]:
    """Makes `depth="auto"` pick one K (0: plain) on every rank, for each of `batches`.

    Every rank runs the same calibration decodes (they hold collectives, so
    all must run them; no rank may take a cached result the others lack),
    then rank 0's measured cycle costs become every rank's calibration
    (`autodepth.remember`): every later "auto" at these batch sizes agrees.

    Returns:
        batch -> the depth "auto" now picks there.
    """
    chosen: dict[int, int] = {}
    if not getattr(runtime, "has_mtp", False):
        return {int(b): 0 for b in batches}

    def decode(prompts: list[list[int]], n: int, k: int) -> tuple[float, int, list[int], list[int]]:
        r = generate_greedy_reference(runtime, prompts, max_new_tokens=n, use_mtp_draft=k > 0, depth=max(k, 1),
                                    enforce_eager=enforce_eager)
        return r.decode_s, r.cycles, list(r.accepted_at), list(r.reached)

    for b in sorted({int(b) for b in batches}):
        costs = autodepth.calibrate(runtime, b, decode)
        keys = sorted(costs.cycle_s, key=int)
        micro = np.array([round(costs.cycle_s[k] * 1e6) for k in keys], dtype=np.int64).clip(0, 2**31 - 1)
        shared = broadcast(group, micro if group.rank() == 0 else None, len(keys))
        costs.cycle_s = {k: float(v) / 1e6 for k, v in zip(keys, shared)}
        autodepth.remember(runtime, b, costs)
        chosen[b] = autodepth.choose_depth(costs)
    return chosen


def silence_other_ranks(group: Any) -> None:
    """Rank > 0 prints nothing: Python-level stdout and stderr go to the null device.

    File descriptors 1 and 2 stay as they are, so `Watchdog` and the
    interpreter's own fatal errors still reach the terminal.
    """
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        sys.stderr = sys.stdout


__all__ = [
    "WATCHDOG_EXIT", "Agreement", "DistributedError", "Watchdog", "agree_auto_depth", "all_gather_ints", "broadcast",
    "check_launch", "folder_fields", "is_transport_error", "lost_peer_message", "silence_other_ranks",
]
