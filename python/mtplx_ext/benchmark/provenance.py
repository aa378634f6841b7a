"""Where a benchmark figure came from: the code, the machine, the libraries, the model, the command.

Every script in `bench/scripts/` that writes JSON stores `provenance(...)`
under the key "provenance", and `bench/scripts/scoreboard.py` builds
`bench/RESULTS.md`'s scoreboard from the files that carry it. The dict is
JSON-ready:

* "commit": the git commit of the checkout this package runs from, and
  "dirty": whether its tracked files differ from that commit; both None
  when the package is not a git checkout's `python/mtplx_ext` (an installed
  wheel), so an installed copy is never credited to whatever repository
  the working directory happens to be in;
* "cpu": the CPU's model name (`engine.autodepth.cpu_model`: /proc/cpuinfo
  on Linux, `sysctl machdep.cpu.brand_string` on macOS,
  `platform.processor()` elsewhere), "cores" (`os.cpu_count()`),
  "usable_cores" (the CPUs this process may run on), "machine" and
  "system";
* "versions": python, mlx, mlx-lm, mtplx-ext, numpy ("not installed" for a
  missing one), and "blas" (the BLAS MLX's matmuls use here);
* "command": `sys.argv` as run, and "utc": when (ISO 8601, seconds);
* "models": for each model folder given, its `weights_hash`.

Paths inside the checkout (the script, the shipped model) are recorded
relative to it; others as given.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mtplx_ext import _blas
from mtplx_ext.benchmark.harness import md_version
from mtplx_ext.decode.autodepth import cpu_model

#: Bytes read from each end of a weight file by the fast hash.
EDGE_BYTES = 1 << 20
#: The MTP head's weight file in the folders `MTPRuntime.save` and `convert` write.
HEAD_FILE = "mtp.safetensors"


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_checkout() -> Path | None:
    """The git checkout whose `python/mtplx_ext` is the package running here, else None."""
    pkg = Path(__file__).resolve().parents[1]  # .../python/mtplx_ext
    root = pkg.parents[1]
    top = _git(pkg, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None
    return root


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of `source_checkout()`; (None, None) outside a checkout.

    Dirty means a tracked file differs from the commit (untracked files, such
    as results being written, do not count).
    """
    root = source_checkout()
    if root is None:
        return None, None
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else bool(status))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _sha256_edges(path: Path, edge: int = EDGE_BYTES) -> str:
    """sha256 of the file's size, its first `edge` bytes and its last `edge` bytes (all of a small file)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= 2 * edge:
            h.update(f.read())
        else:
            h.update(f.read(edge))
            f.seek(size - edge)
            h.update(f.read(edge))
    return h.hexdigest()


def weights_hash(folder: str | Path, full: bool = False) -> dict[str, Any]:
    """A fingerprint of a model folder's weights.

    Fast (the default): sha256 over each `*.safetensors` file's name, size,
    first MiB and last MiB (the whole file when it is 2 MiB or smaller), in
    name order. The first MiB holds the safetensors header (every tensor's
    name, dtype, shape and offset), the last the end of the data; a change
    confined to the middle of a large shard is missed. File times are left
    out on purpose: a model regrown or reconverted with the same bytes keeps
    its hash. `full=True` hashes every byte of every file instead (seconds
    per GB).

    The MTP head's file (`mtp.safetensors`, small) and `config.json` /
    `tokenizer.json` are always hashed in full, so a new head or config shows
    even where the fast hash of a large trunk would not.

    Raises:
        NotADirectoryError: `folder` is not a folder.

    Returns:
        {"path", "method" ("edges-1MiB" or "full"), "sha256", "files",
        "bytes", "head_sha256", "config_sha256", "tokenizer_sha256"} (each
        of the last three None when its file is missing).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a model folder")
    files = sorted(folder.glob("*.safetensors"))
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0".encode())
        h.update((_sha256_file(f) if full else _sha256_edges(f)).encode())
    def whole(name: str) -> str | None:
        return _sha256_file(folder / name) if (folder / name).is_file() else None

    return {
        "path": str(folder), "method": "full" if full else f"edges-{EDGE_BYTES >> 20}MiB", "sha256": h.hexdigest(),
        "files": len(files), "bytes": sum(f.stat().st_size for f in files),
        "head_sha256": whole(HEAD_FILE), "config_sha256": whole("config.json"),
        "tokenizer_sha256": whole("tokenizer.json"),
    }


def _shown(path: str | Path, root: Path | None) -> str:
    """`path` relative to the checkout when inside it (no machine's folder names in results), else as given."""
    try:
        return str(Path(path).resolve().relative_to(root)) if root is not None else str(path)
    except ValueError:
        return str(path)


def _usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def provenance(models: Iterable[str | Path | None] = (), full_hash: bool = False) -> dict[str, Any]:
    """What a benchmark's JSON records about its run (see the module docstring for the keys).

    Args:
        models: the model folders the run measured (None: the shipped model);
            each gets a `weights_hash`, or {"path", "error"} when unreadable.
        full_hash: hash every byte of the weights (`weights_hash(full=True)`).
    """
    from mtplx_ext.shipped import SHIPPED_MODEL

    commit, dirty = git_state()
    root = source_checkout()
    hashed = []
    for m in models:
        path = Path(SHIPPED_MODEL if m is None else m)
        try:
            hashed.append({**weights_hash(path, full=full_hash), "path": _shown(path, root)})
        except OSError as e:
            hashed.append({"path": _shown(path, root), "error": str(e)})
    return {
        "commit": commit, "dirty": dirty,
        "cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": _usable_cores(),
        "machine": platform.machine(), "system": platform.system(),
        "versions": {
            "python": platform.python_version(), "mlx": md_version("mlx"), "mlx-lm": md_version("mlx-lm"),
            "mtplx-ext": md_version("mtplx-ext"), "numpy": md_version("numpy"),
        },
        "blas": _blas.describe(),
        "command": [_shown(sys.argv[0], root), *sys.argv[1:]] if sys.argv and sys.argv[0] else list(sys.argv),
        "utc": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "models": hashed,
    }


__all__ = ["EDGE_BYTES", "HEAD_FILE", "git_state", "provenance", "source_checkout", "weights_hash"]
