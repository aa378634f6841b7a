"""Fused kernels that one test worker compiled, taken by the others before their next test.

MLX's CPU backend compiles each new fused kernel with the C++ compiler (about
half a second each) and keeps it as `<tmp>/mlx/<version>/cpu/lib<name>.so`.
Each worker of a parallel run has a temp directory of its own (`conftest.py`:
the kernel-counting tests must see their own process's builds, and MLX's
check-then-compile is not safe for two processes writing one directory), so
every worker would compile the same kernels again: a third of a cold run's
CPU time. Before each test, a worker hard-links (or copies) into its own cache
the kernels its siblings finished: a file whose last write is over
`SETTLED_S` seconds old (the compiler writes a kernel in milliseconds), linked
under a temporary name and renamed, so MLX never sees a partial file. Nothing
is taken during a test: the kernel counts a test takes stay its own.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

SETTLED_S = 2.0  # a kernel file unchanged this long is complete
EVERY_S = 0.5  # most often a worker looks at its siblings' caches

_last = 0.0
_taken: set[str] = set()


def _cache(tmp: Path) -> Path | None:
    mlx = tmp / "mlx"
    if not mlx.is_dir():
        return None
    versions = sorted(p for p in mlx.iterdir() if (p / "cpu").is_dir())
    return versions[-1] / "cpu" if versions else None


def take_siblings_kernels(own_tmp: str, prefix: str) -> int:
    """Links finished kernels of the sibling temp dirs `<parent>/<prefix>*` into `own_tmp`'s cache; returns how many."""
    global _last
    now = time.time()
    if now - _last < EVERY_S:
        return 0
    _last = now
    own = Path(own_tmp)
    taken = 0
    for sibling in own.parent.glob(prefix + "*"):
        if sibling == own:
            continue
        theirs = _cache(sibling)
        if theirs is None:
            continue
        mine = own / "mlx" / theirs.parent.name / "cpu"
        for entry in os.scandir(theirs):
            name = entry.name
            if name in _taken or not (name.startswith("lib") and name.endswith(".so")):
                continue
            try:
                if now - entry.stat().st_mtime < SETTLED_S:
                    continue
                mine.mkdir(parents=True, exist_ok=True)
                target = mine / name
                if not target.exists():
                    part = mine / f".{name}.{os.getpid()}.part"
                    try:
                        os.link(entry.path, part)
                    except OSError:  # another filesystem: a copy
                        shutil.copyfile(entry.path, part)
                    os.replace(part, target)
                    taken += 1
                _taken.add(name)
            except OSError:
                continue  # a sibling cleaning up: take it next time or compile it
    return taken
