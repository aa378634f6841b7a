"""Starts the ranks of a distributed run on 127.0.0.1 (MLX's ring backend) as subprocesses, with a deadline.

What `mlx.launch --backend ring` does for one host, without its process
manager: a hostfile of free loopback ports, MLX_RANK / MLX_HOSTFILE per
rank. Every rank is killed at the deadline, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mtplx_ext

PYTHON_DIR = str(Path(mtplx_ext.__file__).resolve().parents[1])
WORKER = str(Path(__file__).resolve().parent / "distributed" / "_worker.py")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Rank:
    rc: int | None  # None: killed at the deadline
    out: str
    err: str
    seconds: float


def hostfile(tmp: Path, n: int) -> Path:
    path = tmp / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def spawn(argv: list[str], tmp: Path, n: int = 2, env: dict | None = None,
          per_rank: list[list[str]] | None = None) -> list[subprocess.Popen]:
    """Starts `python argv...` once per rank (rank r appends per_rank[r])."""
    hosts = hostfile(tmp, n)
    base = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
                MLX_HOSTFILE=str(hosts), **(env or {}))
    procs = []
    for r in range(n):
        extra = per_rank[r] if per_rank else []
        procs.append(subprocess.Popen([sys.executable, *argv, *extra], env={**base, "MLX_RANK": str(r)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait(procs: list[subprocess.Popen], timeout: float) -> list[Rank]:
    """Waits for every rank until `timeout` s from now; kills the ones still running."""
    start = time.monotonic()
    ranks = []
    for p in procs:
        left = max(0.1, timeout - (time.monotonic() - start))
        try:
            out, err = p.communicate(timeout=left)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            rc = None
        ranks.append(Rank(rc, out, err, time.monotonic() - start))
    return ranks


def run(argv: list[str], tmp: Path, n: int = 2, timeout: float = 60, **kw) -> list[Rank]:
    return wait(spawn(argv, tmp, n, **kw), timeout)


def run_worker(spec: dict, tmp: Path, timeout: float = 60) -> tuple[list[Rank], list[dict]]:
    """Runs tests/distributed/_worker.py on 2 ranks; returns the ranks and their result files."""
    sp = tmp / "spec.json"
    sp.write_text(json.dumps(spec))
    ranks = run([WORKER, str(sp), str(tmp / "out")], tmp, timeout=timeout)
    for i, r in enumerate(ranks):
        assert r.rc == 0, f"rank {i} exited {r.rc}:\n{r.err[-3000:]}"
    return ranks, [json.loads((tmp / f"out.{i}.json").read_text()) for i in range(len(ranks))]
