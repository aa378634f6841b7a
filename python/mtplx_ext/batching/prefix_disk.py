"""The prefix cache's disk tier: nodes and states as checksummed safetensors files, within a byte cap.

Every node and state the RAM tier stores is written here too (by a writer
thread, so the engine's step never waits for the disk), and a node or state
the RAM tier no longer holds is read back from here, also after a restart.
File names carry the keys (`n-PARENT-KEY.safetensors` for a node,
`s-KEY.safetensors` for a state), so a walk over a chain needs no file
opened until it finds its next block, and a restart indexes the directory
from the names alone.

A write goes to a temporary file that is renamed into place (a crash leaves
no half file under a real name). A file is trusted only when its metadata
names this format and these weights (`fingerprint`), its key is the one
asked for and re-hashes from its parent and tokens, and the SHA-256 of its
tensors matches: a flipped byte, a truncated file or another model's file
is skipped with one log line and deleted, and the prompt is prefilled as if
the block were not there. The least recently used files go first when the
directory passes `max_bytes`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from mtplx_ext.batching.prefix_blocks import Node, State, block_key

#: The format tag every file's metadata carries (a file of another layout is skipped).
FORMAT = "mtplx-prefix-1"
#: Seconds the writer thread waits for work before it ends (the next write starts another).
WRITER_IDLE_S = 2.0
_NAME = re.compile(r"^(?:n-([0-9a-f]{32})-|s-)([0-9a-f]{32})\.safetensors$")
log = logging.getLogger("mtplx_ext.prefix_cache")


def _to_numpy(a: mx.array) -> tuple[np.ndarray, str]:
    if a.dtype == mx.bfloat16:  # NumPy has no bfloat16: its bits travel as uint16
        return np.array(a.view(mx.uint16)), "bfloat16"
    return np.array(a), str(a.dtype).removeprefix("mlx.core.")


def _to_mlx(a: np.ndarray, dtype: str) -> mx.array:
    x = mx.array(a)
    return x.view(mx.bfloat16) if dtype == "bfloat16" else x


def _digest(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> str:
    """SHA-256 of the metadata (but the digest itself) and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 + n:
        raise ValueError("truncated header")
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


class DiskTier:
    """A directory of nodes and states of one model (`fingerprint`), within `max_bytes`.

    Args:
        directory: where the files live (created if missing).
        max_bytes: most bytes of files kept (least recently used out).
        fingerprint: the weights' fingerprint; files of other weights are skipped.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int, fingerprint: str):
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"prefix_cache_dir {str(self.dir)!r} cannot be created: {e.strerror or e}") from None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ValueError(f"prefix_cache_dir {str(self.dir)!r} is not writable")
        self.max_bytes = int(max_bytes)
        self.fingerprint = fingerprint
        self.lock = threading.Lock()
        self.index: OrderedDict[tuple[str, bytes], int] = OrderedDict()  # (tag, key) -> file bytes, LRU first
        self.children: dict[bytes, set[bytes]] = {}
        self.parents: dict[bytes, bytes] = {}
        self.bytes = 0
        self.stats = {"prefix_disk_hits": 0, "prefix_disk_writes": 0, "prefix_disk_skipped": 0,
                      "prefix_disk_evictions": 0}
        self._scan()
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.thread: threading.Thread | None = None  # started by the first job, gone after WRITER_IDLE_S idle

    # -- index ---------------------------------------------------------------

    def _path(self, tag: str, key: bytes, parent: bytes | None = None) -> Path:
        if tag == "n":
            return self.dir / f"n-{(parent or self.parents[key]).hex()}-{key.hex()}.safetensors"
        return self.dir / f"s-{key.hex()}.safetensors"

    def _scan(self) -> None:
        files = []
        for p in self.dir.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)  # a write a crash cut short
                continue
            m = _NAME.match(p.name)
            if m is None:
                continue
            st = p.stat()
            files.append((st.st_mtime, p.name, m, st.st_size))
        for _, _, m, size in sorted(files):
            key = bytes.fromhex(m.group(2))
            if m.group(1) is not None:
                self._add("n", key, size, bytes.fromhex(m.group(1)))
            else:
                self._add("s", key, size)

    def _add(self, tag: str, key: bytes, size: int, parent: bytes | None = None) -> None:
        old = self.index.pop((tag, key), None)
        self.bytes += size - (old or 0)
        self.index[(tag, key)] = size
        if parent is not None:
            self.parents[key] = parent
            self.children.setdefault(parent, set()).add(key)

    def _forget(self, tag: str, key: bytes) -> Path | None:
        size = self.index.pop((tag, key), None)
        if size is None:
            return None
        self.bytes -= size
        path = self._path(tag, key)
        if tag == "n":
            parent = self.parents.pop(key)
            kids = self.children.get(parent, set())
            kids.discard(key)
            if not kids:
                self.children.pop(parent, None)
        return path

    def has(self, tag: str, key: bytes) -> bool:
        with self.lock:
            return (tag, key) in self.index

    def child_keys(self, key: bytes) -> list[bytes]:
        with self.lock:
            return list(self.children.get(key, ()))

    # -- writes (queued; the writer thread runs them) ------------------------

    def write(self, item: Node | State) -> None:
        """Queues a node or state for writing (arrays read out here, on the caller's thread)."""
        arrays = item.kv if isinstance(item, Node) else item.leaves
        tensors, dtypes = {}, []
        for i, parts in enumerate(arrays):
            for j, a in enumerate(parts):
                tensors[f"a.{i}.{j}"], dt = _to_numpy(a)
                dtypes.append(dt)
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "key": item.key.hex(),
                "layers": json.dumps([len(p) for p in arrays]), "dtypes": json.dumps(dtypes)}
        if isinstance(item, Node):
            tag, parent = "n", item.parent
            meta.update(parent=item.parent.hex(), start=str(item.start), tokens=json.dumps(item.tokens.tolist()))
        else:
            tag, parent = "s", None
            meta.update(boundary=str(item.boundary))
        meta["sha256"] = _digest(tensors, meta)
        self._queue(lambda: self._write(tag, item.key, parent, tensors, meta))

    def _write(self, tag: str, key: bytes, parent: bytes | None, tensors: dict[str, np.ndarray],
               meta: dict[str, str]) -> None:
        path = self._path(tag, key, parent)
        tmp = self.dir / f".{path.name}.{os.getpid()}.tmp"
        data = st_save(tensors, metadata=meta)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with self.lock:
            self._add(tag, key, len(data), parent)
            self.stats["prefix_disk_writes"] += 1
            gone = []
            while self.bytes > self.max_bytes and self.index:
                (t, k), _ = next(iter(self.index.items()))
                gone.append(self._forget(t, k))
                self.stats["prefix_disk_evictions"] += 1
        for p in gone:
            if p is not None:
                p.unlink(missing_ok=True)

    def delete(self, tag: str, key: bytes) -> None:
        """Queues a node's or state's file for deletion."""
        def job() -> None:
            with self.lock:
                path = self._forget(tag, key)
            if path is not None:
                path.unlink(missing_ok=True)
        self._queue(job)

    def _queue(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._writer, name="mtplx-prefix-disk", daemon=True)
                self.thread.start()

    def _writer(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=WRITER_IDLE_S)
            except queue.Empty:
                with self.lock:  # (a job queued meanwhile finds no thread and starts one, or is seen here)
                    if self.jobs.empty():
                        self.thread = None
                        return
                continue
            try:
                if job is None:  # `close`
                    with self.lock:
                        self.thread = None
                    return
                job()
            except Exception as e:  # noqa: BLE001 - a full or read-only disk: the RAM tier goes on without the file
                log.warning("prefix cache: could not write to %s: %s", self.dir, e)
            finally:
                self.jobs.task_done()

    def flush(self) -> None:
        """Waits until every queued write and deletion is done."""
        self.jobs.join()

    def close(self) -> None:
        """Finishes the queued work and stops the writer thread."""
        with self.lock:
            thread = self.thread
        if thread is not None and thread.is_alive():
            self.jobs.put(None)
            thread.join()

    # -- reads ---------------------------------------------------------------

    def read(self, tag: str, key: bytes) -> Node | State | None:
        """The node or state stored under `key`, or None (absent, or skipped as untrustworthy)."""
        with self.lock:
            if (tag, key) not in self.index:
                return None
            path = self._path(tag, key)
            self.index.move_to_end((tag, key))
        try:
            data = path.read_bytes()
            item = self._decode(tag, key, data)
        except FileNotFoundError:
            with self.lock:
                self._forget(tag, key)
            return None
        except Exception as e:  # noqa: BLE001 - any damage: skip the file, prefill instead
            log.warning("prefix cache: skipped %s (%s)", path.name, str(e)[:200] or type(e).__name__)
            self.stats["prefix_disk_skipped"] += 1
            with self.lock:  # out of the index now (no second look), off the disk by the writer
                gone = self._forget(tag, key)
            if gone is not None:
                self._queue(lambda: gone.unlink(missing_ok=True))
            return None
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        self.stats["prefix_disk_hits"] += 1
        return item

    def _decode(self, tag: str, key: bytes, data: bytes) -> Node | State:
        meta = _metadata(data)
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        if meta.get("fingerprint") != self.fingerprint:
            raise ValueError(f"written for other weights ({meta.get('fingerprint')})")
        if meta.get("key") != key.hex():
            raise ValueError("its key is not its name's")
        tensors = st_load(data)
        if _digest(tensors, meta) != meta.get("sha256"):
            raise ValueError("checksum mismatch")
        layers, dtypes = json.loads(meta["layers"]), json.loads(meta["dtypes"])
        flat = iter(dtypes)
        arrays = [[_to_mlx(tensors[f"a.{i}.{j}"], next(flat)) for j in range(n)] for i, n in enumerate(layers)]
        if tag == "s":
            return State(key, int(meta["boundary"]), arrays)
        parent = bytes.fromhex(meta["parent"])
        tokens = np.asarray(json.loads(meta["tokens"]), dtype=np.int64)
        if block_key(parent, tokens) != key:
            raise ValueError("its tokens do not hash to its key")
        if any(a.shape[2] != len(tokens) - 1 for parts in arrays for a in parts):
            raise ValueError("its arrays do not hold its tokens' slots")
        return Node(key, parent, int(meta["start"]), tokens, arrays)

    def metrics(self) -> dict[str, Any]:
        with self.lock:
            return {**self.stats, "prefix_bytes_disk": self.bytes, "prefix_entries_disk": len(self.index)}


def check_dir(directory: Any) -> Path:
    """`prefix_cache_dir` as a Path (a string or path naming a directory, or a path where one can be made).

    Raises:
        TypeError / ValueError: naming `prefix_cache_dir`.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"prefix_cache_dir must be a path, got {type(directory).__name__}")
    p = Path(directory)
    if p.exists() and not p.is_dir():
        raise ValueError(f"prefix_cache_dir {str(p)!r} exists and is not a directory")
    return p


__all__ = ["FORMAT", "DiskTier", "check_dir"]
