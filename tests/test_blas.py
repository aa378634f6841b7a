"""The fast-BLAS route on Linux: same matmul results, and really in use.

Which BLAS libmlx binds is fixed when mlx.core is first imported, so every
check runs in a fresh subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the OpenBLAS shim is Linux-only"
)

# Subprocesses import the same mtplx_ext as this process: the installed
# package in CI, the source tree under PYTHONPATH=python in development.
_SPEC = importlib.util.find_spec("mtplx_ext")
PYTHON_DIR = str(Path(_SPEC.submodule_search_locations[0]).parent)

# Computes float32 / float64 / complex64 matmuls on fresh random inputs, with
# transposed operands and a batch, and saves them with the BLAS status.
_MATMULS = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import mtplx_ext
    from mtplx_ext import _blas
    import mlx.core as mx

    seed, out = int(sys.argv[1]), sys.argv[2]
    rng = np.random.default_rng(seed)
    m, k, n = (int(x) for x in rng.integers(3, 200, size=3))
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    at = np.ascontiguousarray(a.T)
    bt = np.ascontiguousarray(b.T)
    batch_a = rng.standard_normal((3, m, k)).astype(np.float32)
    ca = (a + 1j * rng.standard_normal(a.shape)).astype(np.complex64)
    cb = (b + 1j * rng.standard_normal(b.shape)).astype(np.complex64)
    calls0 = _blas.gemm_calls()
    res = {
        "a": a, "b": b, "batch_a": batch_a, "ca": ca, "cb": cb,
        "f32": np.array(mx.array(a) @ mx.array(b)),
        "f32_tt": np.array(mx.array(at).T @ mx.array(bt).T),
        "f32_batch": np.array(mx.array(batch_a) @ mx.array(b)),
        "f64": np.array(mx.matmul(mx.array(a.astype(np.float64)), mx.array(b.astype(np.float64)), stream=mx.cpu)),
        "c64": np.array(mx.array(ca) @ mx.array(cb)),
    }
    np.savez(out, **res)
    s = _blas.status()
    print(json.dumps({"name": s.name, "active": s.active, "reason": s.reason,
                      "threads": s.threads, "calls_before": calls0,
                      "calls_after": _blas.gemm_calls()}))
    """
)


def _env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MTPLX_BLAS", None)
    env.update(overrides)
    return env


def _run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _matmuls(tmp_path: Path, seed: int, mode: str, **env: str) -> tuple[dict, dict]:
    out = tmp_path / f"{mode}.npz"
    p = _run(_MATMULS, str(seed), str(out), MTPLX_BLAS=mode, **env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), dict(np.load(out))


def _within_gemm_error(got: np.ndarray, a: np.ndarray, b: np.ndarray, eps: float) -> bool:
    # Classic bound for a K-term dot product: |fl(a@b) - a@b| <= K*eps*(|a|@|b|).
    exact = a.astype(np.complex128) @ b.astype(np.complex128)
    bound = a.shape[-1] * eps * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
    return bool(np.all(np.abs(got - exact) <= 2 * bound + 1e-30))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The same fresh random matmuls with MTPLX_BLAS=auto and =reference."""
    tmp = tmp_path_factory.mktemp("blas")
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 31))
    threads = str(int(rng.integers(1, 4)))
    runs = {mode: _matmuls(tmp, seed, mode, MTPLX_BLAS_THREADS=threads) for mode in ("auto", "reference")}
    runs["threads"] = int(threads)
    return runs


def test_openblas_and_reference_matmuls_agree_within_float_rounding(runs):
    fast_info, fast = runs["auto"]
    ref_info, ref = runs["reference"]
    if not fast_info["active"]:
        pytest.skip(f"OpenBLAS route unavailable here: {fast_info['reason']}")
    assert not ref_info["active"]
    np.testing.assert_array_equal(fast["a"], ref["a"])  # same inputs in both runs
    a, b = fast["a"], fast["b"]
    eps32 = float(np.finfo(np.float32).eps)
    for res in (fast, ref):
        assert _within_gemm_error(res["f32"], a, b, eps32)
        assert _within_gemm_error(res["f32_tt"], a, b, eps32)
        assert _within_gemm_error(res["f32_batch"], res["batch_a"], b, eps32)
        assert _within_gemm_error(res["f64"], a, b, eps32)
        assert _within_gemm_error(res["c64"], res["ca"], res["cb"], 2 * eps32)
    for key in ("f32", "f32_tt", "f32_batch", "f64", "c64"):
        assert fast[key].shape == ref[key].shape and fast[key].dtype == ref[key].dtype


def test_openblas_route_is_actually_called_by_mlx_when_enabled(runs):
    info, _ = runs["auto"]
    if info["reason"].startswith("the scipy-openblas32 package is not installed"):
        pytest.skip(info["reason"])
    assert info["active"] and info["name"] == "openblas", info
    assert info["threads"] == runs["threads"]  # MTPLX_BLAS_THREADS is applied
    # Five GEMM-backed matmuls ran (f32 x3, f64, c64); each went through the shim.
    assert info["calls_after"] - info["calls_before"] >= 5


def test_reference_mode_leaves_mlx_on_its_bundled_blas(runs):
    info, _ = runs["reference"]
    assert info["name"] == "reference" and not info["active"]
    assert "MTPLX_BLAS=reference" in info["reason"]
    assert info["calls_after"] == -1  # the shim was never loaded


def test_importing_mlx_first_warns_and_reports_reference_blas():
    code = textwrap.dedent(
        """
        import warnings
        import mlx.core
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import mtplx_ext
        print(mtplx_ext.BLAS.active, "|", mtplx_ext.BLAS.reason, "|",
              [str(x.message) for x in w])
        """
    )
    p = _run(code)
    assert p.returncode == 0, p.stderr
    active, reason, warned = p.stdout.strip().split(" | ")
    assert active == "False"
    assert "mlx.core was imported before mtplx_ext" in reason
    assert "mlx.core was imported before mtplx_ext" in warned


def test_bad_mtplx_blas_value_is_rejected_naming_the_variable():
    p = _run("import mtplx_ext", MTPLX_BLAS="fastest")
    assert p.returncode != 0
    assert "MTPLX_BLAS" in p.stderr and "fastest" in p.stderr


def test_bad_thread_count_is_rejected_naming_the_variable():
    p = _run("import mtplx_ext", MTPLX_BLAS_THREADS="zero")
    assert p.returncode != 0
    assert "MTPLX_BLAS_THREADS" in p.stderr
