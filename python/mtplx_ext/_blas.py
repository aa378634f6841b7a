"""Fast BLAS for MLX's CPU backend on Linux.

MLX's Linux CPU wheel links a reference BLAS, which makes every CPU matmul
about 50x slower than an optimized one. This module loads a small shim
library (``libmtplx_blas_shim.so``, built with the package) that exports the
``cblas_sgemm`` / ``cblas_dgemm`` / ``cblas_cgemm`` symbols libmlx imports and
forwards them to OpenBLAS from the ``scipy-openblas32`` wheel (whose own
symbols carry a ``scipy_`` prefix, so they never clash with anything).
Decode-sized float32 products ``x @ W.T`` with at most 64 rows of x run in
the shim's own decode GEMM instead (AVX-512 or AVX2 + FMA, where the CPU has
them): OpenBLAS packs the whole weight matrix on every call, which costs more
than the product itself at a few rows, while the decode GEMM reads W once per
call whatever the row count and splits large W's columns over two threads.
Each row's result is independent of the other rows of the call.

The shim must be in the process's global symbol scope *before* libmlx is
loaded, i.e. before ``mlx.core`` is first imported: ``import mtplx_ext`` does
this as its very first step. When ``mlx.core`` was already imported, MLX keeps
its reference BLAS for the life of the process; :func:`load` then leaves
everything as it is and reports it (``BlasStatus.active`` is False and
``reason`` says why) with a warning.

Environment:
    MTPLX_BLAS: ``auto`` (default: OpenBLAS when available on Linux),
        ``openblas`` (as auto, but warn when it cannot be used), or
        ``reference`` (never load it; MLX keeps its bundled BLAS).
    MTPLX_BLAS_THREADS: OpenBLAS thread count (default: OPENBLAS_NUM_THREADS
        if set, else half the CPUs this process may run on, 1 to 8).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BlasStatus",
    "load",
    "status",
    "gemm_calls",
    "small_gemm_calls",
    "split_gemm_calls",
    "set_small_gemm_rows",
    "set_gemm_kernel",
    "set_gemm_split_bytes",
    "describe",
]

#: Kernels the shim can run decode-sized products in (`set_gemm_kernel`).
GEMM_KERNELS = ("decode", "small")

SHIM_NAME = "libmtplx_blas_shim.so"
_MAX_DEFAULT_THREADS = 8


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS MLX's CPU matmuls use in this process.

    Attributes:
        name: ``"openblas"``, ``"reference"`` (the BLAS bundled with the mlx
            Linux wheel) or ``"accelerate"`` (macOS, MLX's own choice).
        active: True when MLX's GEMM calls go through the shim to OpenBLAS.
        reason: why the shim is not active (empty when it is).
        library: path of the OpenBLAS library in use, or "".
        version: the OpenBLAS configuration string, or "".
        threads: OpenBLAS threads, or 0 when not active.
    """

    name: str
    active: bool
    reason: str = ""
    library: str = ""
    version: str = ""
    threads: int = 0


_status: BlasStatus | None = None
_shim: ctypes.CDLL | None = None


def _default_threads() -> int:
    for var in ("MTPLX_BLAS_THREADS", "OPENBLAS_NUM_THREADS"):
        env = os.environ.get(var)
        if env:
            try:
                n = int(env)
            except ValueError:
                raise ValueError(f"{var} must be a positive integer, got {env!r}") from None
            if n < 1:
                raise ValueError(f"{var} must be >= 1, got {n}")
            return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    # Half the CPUs: MLX runs its own CPU threads next to OpenBLAS's, and
    # decode-sized GEMMs gain little from more threads. Measured on a busy
    # 2-core machine, 2 OpenBLAS threads made batch-8 decoding ~6x slower
    # than 1 (the threads spin while competing for the cores).
    return max(1, min(cpus // 2, _MAX_DEFAULT_THREADS))


def _find_openblas() -> Path | None:
    # Locate the wheel without importing it: its __init__ loads the library
    # itself, which is harmless but not needed here.
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    if not lib_dir.is_dir():
        return None
    libs = sorted(p for p in lib_dir.iterdir() if p.name.startswith("libscipy_openblas") and ".so" in p.name)
    return libs[0] if libs else None


def _reference(reason: str) -> BlasStatus:
    return BlasStatus(name="reference", active=False, reason=reason)


def load() -> BlasStatus:
    """Routes MLX's CPU GEMMs to OpenBLAS if that is still possible.

    Safe to call many times; only the first call acts. Must run before
    ``mlx.core`` is first imported to have any effect.

    Returns:
        The resulting :class:`BlasStatus` (also kept for :func:`status`).
    """
    global _status, _shim
    if _status is not None:
        return _status
    if sys.platform == "darwin":
        _status = BlasStatus(name="accelerate", active=False, reason="macOS: MLX uses Accelerate")
        return _status
    if not sys.platform.startswith("linux"):
        _status = _reference(f"no fast BLAS route on {sys.platform}")
        return _status

    mode = os.environ.get("MTPLX_BLAS", "auto").strip().lower()
    if mode not in ("auto", "openblas", "reference"):
        raise ValueError(
            f"MTPLX_BLAS must be 'auto', 'openblas' or 'reference', got {mode!r}"
        )
    if mode == "reference":
        _status = _reference("disabled by MTPLX_BLAS=reference")
        return _status

    threads = _default_threads()  # validates MTPLX_BLAS_THREADS up front

    def fail(reason: str) -> BlasStatus:
        if mode == "openblas":
            warnings.warn(f"mtplx_ext: fast BLAS not loaded: {reason}", RuntimeWarning, stacklevel=3)
        return _reference(reason)

    if "mlx.core" in sys.modules:
        # libmlx is already bound to its bundled reference BLAS.
        reason = (
            "mlx.core was imported before mtplx_ext, so MLX keeps its reference "
            "BLAS in this process (CPU matmuls ~50x slower); import mtplx_ext "
            "before mlx to get OpenBLAS"
        )
        warnings.warn(f"mtplx_ext: {reason}", RuntimeWarning, stacklevel=3)
        _status = _reference(reason)
        return _status

    shim_found = shim_path()
    if shim_found is None:
        _status = fail(f"{SHIM_NAME} is not installed next to mtplx_ext")
        return _status
    openblas = _find_openblas()
    if openblas is None:
        _status = fail("the scipy-openblas32 package is not installed (pip install scipy-openblas32)")
        return _status

    try:
        shim = ctypes.CDLL(str(shim_found), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        _status = fail(f"cannot load {shim_found.name}: {e}")
        return _status
    shim.mtplx_blas_bind.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    shim.mtplx_blas_bind.restype = ctypes.c_int
    shim.mtplx_blas_error.restype = ctypes.c_char_p
    shim.mtplx_blas_config.restype = ctypes.c_char_p
    shim.mtplx_blas_calls.restype = ctypes.c_longlong
    shim.mtplx_blas_set_threads.argtypes = [ctypes.c_int]
    shim.mtplx_blas_small_calls.restype = ctypes.c_longlong
    shim.mtplx_blas_set_small_rows.argtypes = [ctypes.c_int]
    shim.mtplx_blas_set_small_rows.restype = ctypes.c_int
    shim.mtplx_blas_split_calls.restype = ctypes.c_longlong
    shim.mtplx_blas_set_kernel.argtypes = [ctypes.c_int]
    shim.mtplx_blas_set_kernel.restype = ctypes.c_int
    shim.mtplx_blas_set_split_bytes.argtypes = [ctypes.c_longlong]
    shim.mtplx_blas_set_split_bytes.restype = ctypes.c_longlong
    if shim.mtplx_blas_bind(str(openblas).encode(), b"scipy_") != 0:
        # The shim is global now but unbound: any GEMM through it would abort,
        # so this is an error, not a fallback.
        raise ImportError(
            f"mtplx_ext: fast BLAS shim failed to bind {openblas}: "
            f"{shim.mtplx_blas_error().decode()}; set MTPLX_BLAS=reference to run without it"
        )
    shim.mtplx_blas_set_threads(threads)
    _shim = shim
    _status = BlasStatus(
        name="openblas",
        active=True,
        library=str(openblas),
        version=shim.mtplx_blas_config().decode(),
        threads=shim.mtplx_blas_get_threads(),
    )
    return _status


def shim_path() -> Path | None:
    """The installed shim: next to this file, or (an editable install) next to the built extension."""
    here = Path(__file__).with_name(SHIM_NAME)
    if here.exists():
        return here
    # Locating the extension does not import it (nor mlx.core).
    spec = importlib.util.find_spec("mtplx_ext._ext")
    if spec is not None and spec.origin:
        built = Path(spec.origin).with_name(SHIM_NAME)
        if built.exists():
            return built
    return None


def status() -> BlasStatus:
    """The BLAS in use (runs :func:`load` first if nothing has yet)."""
    return _status if _status is not None else load()


def gemm_calls() -> int:
    """GEMM calls forwarded to OpenBLAS so far (-1 when the shim is not loaded)."""
    return int(_shim.mtplx_blas_calls()) if _shim is not None else -1


def small_gemm_calls() -> int:
    """Products the shim's own kernels computed (-1 without the shim).

    Decode-sized float32 products x @ W.T with at most a few dozen rows of x
    skip OpenBLAS, which packs the whole weight matrix on every call.
    """
    return int(_shim.mtplx_blas_small_calls()) if _shim is not None else -1


def split_gemm_calls() -> int:
    """Decode-GEMM products whose columns ran on two threads (-1 without the shim)."""
    return int(_shim.mtplx_blas_split_calls()) if _shim is not None else -1


def set_small_gemm_rows(rows: int) -> int:
    """Most rows of x the shim's kernels take (0 sends everything to OpenBLAS).

    For benchmarks and tests that compare paths in one process; the default
    (and the most, larger values are clamped) is 64. Returns the previous
    limit (-1 and no effect without the shim).
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be an int >= 0, got {rows!r}")
    return int(_shim.mtplx_blas_set_small_rows(rows)) if _shim is not None else -1


def set_gemm_kernel(kernel: str) -> str:
    """Which shim kernel takes decode-sized products; returns the previous one.

    ``"decode"`` (the default): the decode GEMM, up to 64 rows, two threads
    on large weights. ``"small"``: the older one-thread small-row kernel,
    which takes at most 8 rows (more go to OpenBLAS); kept for comparisons.
    Returns ``""`` (no effect) without the shim.

    Raises:
        ValueError: a kernel not in `GEMM_KERNELS`.
    """
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"kernel must be one of {GEMM_KERNELS}, got {kernel!r}")
    if _shim is None:
        return ""
    return GEMM_KERNELS[int(_shim.mtplx_blas_set_kernel(GEMM_KERNELS.index(kernel)))]


def set_gemm_split_bytes(nbytes: int | None) -> int | None:
    """Weight size (bytes of W) from which the decode GEMM uses two threads.

    The columns of W are split between the calling thread and one worker
    thread of the shim; below the threshold the hand-off costs more than the
    second core saves. None never splits. Returns the previous threshold
    (None also when the shim is not loaded, and then nothing changes).

    Raises:
        ValueError: not None and not an int >= 0.
    """
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
        raise ValueError(f"nbytes must be None or an int >= 0, got {nbytes!r}")
    if _shim is None:
        return None
    prev = int(_shim.mtplx_blas_set_split_bytes(-1 if nbytes is None else nbytes))
    return None if prev < 0 else prev


def describe() -> str:
    """One line for reports, e.g. ``openblas (OpenBLAS 0.3.x ..., 2 threads)``."""
    s = status()
    if s.active:
        return f"openblas ({s.version}, {s.threads} threads)"
    return f"{s.name} ({s.reason})"
