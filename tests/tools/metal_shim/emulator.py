"""Builds the threadgroup emulator and runs Metal kernels on numpy buffers.

The emulator library holds every kernel of ``metal/*.metal``, taken from the
one flattened source that a macOS build without the metallib embeds
(cmake/embed_metal.py; translated by metal2cpp.py, compiled as C++ against
metal_shim.h), plus the deliberately broken fixtures of ``broken/``, the
self-test kernels of ``probes/``, the fiber runtime and the primitives' host
launch plans. Kernels are looked up by their Metal host name; fixture kernels
are named ``broken/<fixture>/<host name>``, probes ``probe/<name>``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .metal2cpp import SHIM_DIR, translate

REPO = SHIM_DIR.parents[2]
METAL_DIR = REPO / "metal"
BROKEN_DIR = SHIM_DIR / "broken"
PROBE_DIR = SHIM_DIR / "probes"
CXX_FLAGS = ["-std=c++17", "-O1", "-fPIC", "-g0", "-w"]
if os.environ.get("MTPLX_EMU_UCONTEXT"):  # portable fiber switch (slower)
    CXX_FLAGS.append("-DMEMU_USE_UCONTEXT")
LIB_NAME = "libmetal_emu.so"
EMBED_SCRIPT = REPO / "cmake" / "embed_metal.py"
EMBEDDED_NAME = "mtplx_ext_embedded.metal"


class EmulatorError(RuntimeError):
    """A kernel failed under the emulator (race, deadlock, bad access)."""


def clang() -> str | None:
    """The clang++ executable, or None where it is not installed."""
    return shutil.which(os.environ.get("MTPLX_CLANGXX", "clang++"))


@functools.cache
def embed_module():
    """cmake/embed_metal.py, the macOS build's kernel-source flattener."""
    spec = importlib.util.spec_from_file_location("mtplx_embed_metal", EMBED_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def embedded_source() -> str:
    """metal/*.metal as one source, exactly as a macOS build embeds it."""
    embed = embed_module()
    return embed.flatten(embed.metal_sources(METAL_DIR), [METAL_DIR])


def kernel_sources(work: Path) -> list[tuple[Path, str]]:
    """(.metal file, host-name prefix) of every kernel the library holds.

    The real kernels run from the embedded source (written into `work`), so
    the emulator covers the very text a macOS build without the metallib
    compiles; its line markers name the original files.
    """
    flat = work / EMBEDDED_NAME
    flat.write_text(embedded_source())
    srcs = [(flat, "")]
    srcs += [(p, f"broken/{p.stem}/") for p in sorted(BROKEN_DIR.glob("*.metal"))]
    srcs += [(p, "probe/") for p in sorted(PROBE_DIR.glob("*.metal"))]
    return srcs


def _inputs_digest(cxx: str) -> str:
    h = hashlib.sha256()
    files = sorted(METAL_DIR.glob("*")) + sorted(SHIM_DIR.rglob("*"))
    files += sorted((REPO / "csrc" / "metal").glob("*.h")) + [EMBED_SCRIPT]
    for f in files:
        if f.is_file() and f.suffix not in (".pyc", ".md") and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(REPO)).encode())
            h.update(f.read_bytes())
    ver = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h.update(ver.encode())
    h.update(" ".join(CXX_FLAGS).encode())
    return h.hexdigest()[:16]


def build(cache_root: Path, jobs: int = 2) -> Path:
    """Compiles the emulator library (once per set of inputs).

    Args:
        cache_root: directory for build products; a build whose inputs
            (sources, shim, compiler, flags) are unchanged is reused.
        jobs: parallel compiler processes.

    Returns:
        Path of the shared library.
    """
    cxx = clang()
    if cxx is None:
        raise FileNotFoundError("clang++ not found")
    out = cache_root / _inputs_digest(cxx)
    lib = out / LIB_NAME
    if lib.exists():
        os.utime(out)  # in use: keep it from being pruned
        return lib
    work = cache_root / f"tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    includes = [f"-I{SHIM_DIR}", f"-I{REPO / 'csrc'}", f"-I{METAL_DIR}"]
    units = [SHIM_DIR / "emu_runtime.cpp", SHIM_DIR / "host_glue.cpp"]
    for src, prefix in kernel_sources(work):
        # The embedded source must need no include directory.
        dirs = [] if src.name == EMBEDDED_NAME else [METAL_DIR]
        cpp, _ = translate(src, dirs, prefix)
        name = (prefix.replace("/", "_") + src.stem) or src.stem
        dst = work / f"{name}.cpp"
        dst.write_text(cpp)
        units.append(dst)
    procs: list[tuple[subprocess.Popen, Path]] = []
    objects = []
    failures = []

    def reap(p: subprocess.Popen, unit: Path) -> None:
        _, err = p.communicate()
        if p.returncode != 0:
            failures.append(f"{unit.name}:\n{err}")

    for unit in units:
        obj = work / (unit.stem + ".o")
        objects.append(obj)
        cmd = [cxx, *CXX_FLAGS, *includes, "-c", str(unit), "-o", str(obj)]
        procs.append(
            (subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True), unit)
        )
        if len(procs) >= jobs:
            reap(*procs.pop(0))
    for p, unit in procs:
        reap(p, unit)
    if failures:
        raise RuntimeError("emulator build failed:\n" + "\n".join(failures))
    res = subprocess.run(
        [cxx, "-shared", "-o", str(work / LIB_NAME), *map(str, objects), "-lpthread"],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise RuntimeError("emulator link failed:\n" + res.stderr)
    try:
        work.rename(out)
    except OSError:  # another process finished the same build first
        shutil.rmtree(work, ignore_errors=True)
    for old in cache_root.iterdir():  # builds of older inputs, not in use
        if old != out and time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    return lib


_ERR_LEN = 4096


class Emulator:
    """ctypes front end of the emulator library."""

    def __init__(self, lib_path: Path | str):
        self.path = Path(lib_path)
        self.lib = ctypes.CDLL(str(lib_path))
        c = ctypes
        self.lib.memu_launch.argtypes = [
            c.c_char_p,
            c.POINTER(c.c_uint32),
            c.POINTER(c.c_uint32),
            c.c_int,
            c.POINTER(c.c_void_p),
            c.POINTER(c.c_uint64),
            c.c_int,
            c.POINTER(c.c_uint64),
            c.c_double,
            c.c_char_p,
            c.c_int,
        ]
        self.lib.memu_verify_greedy.argtypes = [
            c.c_char_p,
            c.c_void_p,
            c.c_uint64,
            c.c_char_p,
            c.c_void_p,
            c.c_uint64,
            c.c_int,
            c.c_void_p,
            c.c_uint64,
            c.c_int,
            c.c_int,
            c.c_int,
            c.c_char_p,
            c.c_int,
        ]
        self.lib.memu_state_copy.argtypes = [
            c.c_char_p,
            c.c_int,
            c.POINTER(c.c_void_p),
            c.POINTER(c.c_void_p),
            c.POINTER(c.c_void_p),
            c.POINTER(c.c_uint64),
            c.POINTER(c.c_uint64),
            c.c_void_p,
            c.c_uint64,
            c.c_int,
            c.c_int,
            c.c_char_p,
            c.c_int,
        ]

    def kernel_names(self) -> list[str]:
        n = self.lib.memu_kernel_names(None, 0)
        buf = ctypes.create_string_buffer(n)
        self.lib.memu_kernel_names(buf, n)
        return [s for s in buf.value.decode().split("\n") if s]

    @staticmethod
    def _check(rc: int, err: ctypes.Array) -> None:
        if rc != 0:
            raise EmulatorError(err.value.decode(errors="replace"))

    def launch(
        self,
        name: str,
        grid: Sequence[int],
        threads: Sequence[int] | int,
        buffers: Sequence[np.ndarray | None],
        threadgroup_lengths: Sequence[int] = (),
        timeout: float = 120.0,
    ) -> None:
        """Runs kernel `name` as Metal's dispatchThreadgroups would.

        Args:
            name: the kernel's host name.
            grid: threadgroups per grid (up to 3 dims).
            threads: threads per threadgroup (int or up to 3 dims).
            buffers: buffer slot i gets buffers[i] (None: unbound). Arrays
                must be C-contiguous; the kernel writes them in place.
            threadgroup_lengths: bytes of each [[threadgroup(n)]] parameter.
            timeout: seconds before a runaway launch aborts the process.

        Raises:
            EmulatorError: the emulator's report (race, deadlock, bad access).
        """
        if isinstance(threads, int):
            threads = (threads,)
        g = (ctypes.c_uint32 * 3)(*(list(grid) + [1, 1, 1])[:3])
        t = (ctypes.c_uint32 * 3)(*(list(threads) + [1, 1, 1])[:3])
        n = len(buffers)
        ptrs = (ctypes.c_void_p * max(n, 1))()
        sizes = (ctypes.c_uint64 * max(n, 1))()
        for i, b in enumerate(buffers):
            if b is None:
                continue
            if not b.flags.c_contiguous:
                raise ValueError(f"buffer {i} is not C-contiguous")
            ptrs[i] = b.ctypes.data
            sizes[i] = b.nbytes
        lens = (ctypes.c_uint64 * max(len(threadgroup_lengths), 1))(
            *threadgroup_lengths
        )
        err = ctypes.create_string_buffer(_ERR_LEN)
        rc = self.lib.memu_launch(
            name.encode(),
            g,
            t,
            n,
            ptrs,
            sizes,
            len(threadgroup_lengths),
            lens,
            timeout,
            err,
            _ERR_LEN,
        )
        self._check(rc, err)

    def verify_greedy(
        self,
        logits: np.ndarray,
        dtype: str,
        tokens: np.ndarray,
        bundle: np.ndarray,
        threads: int = 0,
        prefix: str = "",
    ) -> np.ndarray:
        """verify_greedy's Metal launch (host plan included) into `bundle`.

        Args:
            logits: [B, 2, V] raw logits: float32, float16, or uint16 bits
                for bfloat16.
            dtype: "float32", "float16" or "bfloat16".
            tokens: [B, 2] int32 or int64.
            bundle: [B, 5] int32 output (poison it first).
            threads: threads per threadgroup; 0 lets the host plan choose.
            prefix: "broken/<fixture>/" runs a fixture's copy of the kernel.
        """
        B, _, V = logits.shape
        for name, a in (("logits", logits), ("tokens", tokens), ("bundle", bundle)):
            if not a.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous")
        err = ctypes.create_string_buffer(_ERR_LEN)
        rc = self.lib.memu_verify_greedy(
            prefix.encode(),
            logits.ctypes.data,
            logits.nbytes,
            dtype.encode(),
            tokens.ctypes.data,
            tokens.nbytes,
            int(tokens.dtype == np.int64),
            bundle.ctypes.data,
            bundle.nbytes,
            B,
            V,
            threads,
            err,
            _ERR_LEN,
        )
        self._check(rc, err)
        return bundle

    def state_copy(
        self,
        snapshot: Sequence[np.ndarray],
        outputs: Sequence[np.ndarray],
        live: Sequence[np.ndarray] | None = None,
        row_mask: np.ndarray | None = None,
        threads: int = 0,
        prefix: str = "",
    ) -> None:
        """snapshot_state / restore_state's Metal launches into `outputs`.

        Without `row_mask` every output gets the snapshot's bytes; with it,
        row b of each leaf comes from the snapshot where row_mask[b] is set
        and from `live` elsewhere.
        """
        n = len(snapshot)
        masked = row_mask is not None
        live = live if live is not None else snapshot
        arrs = list(snapshot) + list(live) + list(outputs)
        for a in arrs:
            if not a.flags.c_contiguous:
                raise ValueError("state leaves must be C-contiguous")
        P = ctypes.c_void_p * max(n, 1)
        U = ctypes.c_uint64 * max(n, 1)
        err = ctypes.create_string_buffer(_ERR_LEN)
        mask = (
            np.ascontiguousarray(row_mask, dtype=np.bool_) if masked else None
        )
        rc = self.lib.memu_state_copy(
            prefix.encode(),
            n,
            P(*[a.ctypes.data for a in snapshot]),
            P(*[a.ctypes.data for a in live]),
            P(*[a.ctypes.data for a in outputs]),
            U(*[a.nbytes for a in snapshot]),
            U(*[a.shape[0] if a.ndim else 1 for a in snapshot]),
            mask.ctypes.data if masked else None,
            mask.nbytes if masked else 0,
            int(masked),
            threads,
            err,
            _ERR_LEN,
        )
        self._check(rc, err)
