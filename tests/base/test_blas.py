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
import _seed

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
    rng = _seed.rng()
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


# Decode-sized products x @ W.T through the shim's older small-row kernel
# (still selectable), against float64 and against OpenBLAS in the same
# process (the kernel switched off).
_SMALL = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import mtplx_ext
    from mtplx_ext import _blas
    import mlx.core as mx

    seed, out = int(sys.argv[1]), sys.argv[2]
    rng = np.random.default_rng(seed)
    if not _blas.status().active:
        print(json.dumps({"active": False, "reason": _blas.status().reason}))
        sys.exit(0)
    assert _blas.set_gemm_kernel("small") == "decode"  # the default

    def poison(nbytes):
        # NaN bit patterns in freed buffers: a product with beta = 0 that read
        # its output buffer would come out NaN.
        junk = [mx.full((nbytes // 4 + 1,), 0x7FC00000, dtype=mx.int32) for _ in range(4)]
        mx.eval(junk)

    cases, res = [], {}
    for i in range(40):
        m = int(rng.integers(1, 11))          # 9 and 10 rows go to OpenBLAS
        n = int(rng.choice([1, 3, 5, 64, 193, 2048]))
        k = int(rng.choice([1, 7, 8, 13, 192, 577]))
        x = rng.standard_normal((m, k)).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3])
        w = rng.standard_normal((n, k)).astype(np.float32)
        pad = int(rng.integers(0, 3))  # strided rows of x: a leading dimension > k
        xs = mx.array(np.pad(x, ((0, 0), (0, pad))))[:, :k]
        ws = mx.array(w)
        poison(m * n * 4)
        before = _blas.small_gemm_calls()
        got = xs @ ws.T
        mx.eval(got)
        used = _blas.small_gemm_calls() - before
        prev = _blas.set_small_gemm_rows(0)
        poison(m * n * 4)
        ob = xs @ ws.T
        mx.eval(ob)
        _blas.set_small_gemm_rows(prev)
        # Row independence: each row alone gives the same bits as in the batch.
        alone = mx.concatenate([xs[r : r + 1] @ ws.T for r in range(m)], axis=0)
        # alpha / beta: addmm computes beta * c + alpha * (x @ w.T).
        c = rng.standard_normal((m, n)).astype(np.float32)
        mm = mx.addmm(mx.array(c), xs, ws.T, alpha=0.5, beta=-2.0)
        res[f"x{i}"], res[f"w{i}"], res[f"c{i}"] = x, w, c
        res[f"got{i}"], res[f"ob{i}"] = np.array(got), np.array(ob)
        res[f"alone{i}"], res[f"mm{i}"] = np.array(alone), np.array(mm)
        cases.append({"m": m, "n": n, "k": k, "small_calls": int(used)})
    # Non-finite inputs propagate as in any dot product.
    x = rng.standard_normal((3, 16)).astype(np.float32)
    x[1, 5] = np.nan
    x[2, 0] = np.inf
    res["nf_x"] = x
    res["nf_w"] = np.abs(rng.standard_normal((4, 16))).astype(np.float32)
    res["nf"] = np.array(mx.array(x) @ mx.array(res["nf_w"]).T)
    np.savez(out, **res)
    print(json.dumps({"active": True, "cases": cases}))
    """
)


def test_small_row_products_match_float64_and_openblas_and_are_row_independent(tmp_path):
    seed = int(_seed.rng().integers(1 << 31))
    print(f"random seed {seed}")
    out = tmp_path / "small.npz"
    p = _run(_SMALL, str(seed), str(out))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout.strip().splitlines()[-1])
    if not info["active"]:
        pytest.skip(f"OpenBLAS route unavailable here: {info['reason']}")
    r = dict(np.load(out))
    eps32 = float(np.finfo(np.float32).eps)
    has_fma = "avx2" in open("/proc/cpuinfo").read() and " fma" in open("/proc/cpuinfo").read()
    for i, case in enumerate(info["cases"]):
        x, w, c = r[f"x{i}"], r[f"w{i}"], r[f"c{i}"]
        what = f"case {case}"
        # The kernel takes 1..8 rows (where the CPU has AVX2 + FMA), OpenBLAS the
        # rest; a [1, 1] weight is contiguous both ways and MLX passes it untransposed.
        takes = has_fma and case["m"] <= 8 and case["n"] * case["k"] > 1
        assert case["small_calls"] == int(takes), what
        assert _within_gemm_error(r[f"got{i}"], x, w.T, eps32), what
        assert _within_gemm_error(r[f"ob{i}"], x, w.T, eps32), what
        if case["m"] <= 8:  # within the kernel, rows alone and together agree bit for bit
            np.testing.assert_array_equal(r[f"alone{i}"], r[f"got{i}"], err_msg=what)
        exact = -2.0 * c.astype(np.float64) + 0.5 * (x.astype(np.float64) @ w.T.astype(np.float64))
        bound = 2 * (x.shape[1] + 2) * eps32 * (2 * np.abs(c) + 0.5 * (np.abs(x).astype(np.float64) @ np.abs(w).T))
        assert np.all(np.abs(r[f"mm{i}"] - exact) <= bound + 1e-30), what
    nf = r["nf"]
    assert np.isfinite(nf[0]).all() and np.isnan(nf[1]).all() and np.isposinf(nf[2]).all()
    assert any(c["small_calls"] for c in info["cases"]) == has_fma


def test_the_shim_is_found_next_to_the_built_extension_when_not_next_to_the_sources(tmp_path, monkeypatch):
    # An editable install keeps the sources in the tree and the built files
    # (extension, shim) in site-packages: the shim must still be found there.
    from mtplx_ext import _blas

    ext = importlib.util.find_spec("mtplx_ext._ext")
    built = Path(ext.origin).with_name(_blas.SHIM_NAME)
    if not built.exists():
        pytest.skip("this build has no BLAS shim")
    monkeypatch.setattr(_blas, "__file__", str(tmp_path / "_blas.py"))
    assert _blas.shim_path() == built
    # Neither next to the sources nor next to the extension: none.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert _blas.shim_path() is None


# The decode GEMM (the default for 1..64 rows): fresh random shapes against
# float64, each row's bits alone and in the call, one thread against two,
# alpha / beta, and which products it takes.
_DECODE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import mtplx_ext
    from mtplx_ext import _blas
    import mlx.core as mx

    seed, out = int(sys.argv[1]), sys.argv[2]
    rng = np.random.default_rng(seed)
    if not _blas.status().active:
        print(json.dumps({"active": False, "reason": _blas.status().reason}))
        sys.exit(0)
    default_split = _blas.set_gemm_split_bytes(None)

    def poison(nbytes):
        junk = [mx.full((nbytes // 4 + 1,), 0x7FC00000, dtype=mx.int32) for _ in range(4)]
        mx.eval(junk)

    def product(xs, ws, split):
        _blas.set_gemm_split_bytes(split)
        poison(xs.shape[0] * ws.shape[0] * 4)
        y = xs @ ws.T
        mx.eval(y)
        return np.array(y)

    cases, res = [], {}
    rows = [1, 64, 65] + [int(m) for m in rng.integers(2, 64, size=13)]
    for i, m in enumerate(rows):
        # Odd sizes: K tails below one vector, N tails below one tile, and
        # weights spanning several column blocks and thread chunks.
        n = int(rng.choice([1, 5, 23, 25, 97, 301, 1000]))
        k = int(rng.choice([1, 7, 15, 17, 33, 190, 577]))
        if i == 0:  # a 2.3 MB weight: split over threads when allowed
            n, k = 1000, 577
        x = rng.standard_normal((m, k)).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3])
        w = rng.standard_normal((n, k)).astype(np.float32)
        pad = int(rng.integers(0, 3))  # strided rows of x
        xs = mx.array(np.pad(x, ((0, 0), (0, pad))))[:, :k]
        ws = mx.array(w)
        small0, split0 = _blas.small_gemm_calls(), _blas.split_gemm_calls()
        one = product(xs, ws, None)
        small1 = _blas.small_gemm_calls()
        two = product(xs, ws, 0)
        split1 = _blas.split_gemm_calls()
        # Rows alone, and a random subset of rows, each in its own call.
        _blas.set_gemm_split_bytes(0)
        alone = np.concatenate([product(xs[r : r + 1], ws, 0) for r in range(m)], axis=0)
        lo, hi = sorted(int(v) for v in rng.integers(0, m + 1, size=2))
        part = product(xs[lo : max(hi, lo + 1)], ws, 0)
        alpha, beta = (float(v) for v in rng.uniform(-2, 2, size=2))
        c = rng.standard_normal((m, n)).astype(np.float32)
        mm = mx.addmm(mx.array(c), xs, ws.T, alpha=alpha, beta=beta)
        res.update({f"x{i}": x, f"w{i}": w, f"c{i}": c, f"one{i}": one, f"two{i}": two,
                    f"alone{i}": alone, f"part{i}": part, f"mm{i}": np.array(mm)})
        cases.append({"m": m, "n": n, "k": k, "lo": lo, "alpha": alpha, "beta": beta,
                      "small": int(small1 - small0), "split": int(split1 - split0)})
    _blas.set_gemm_split_bytes(default_split)
    np.savez(out, **res)
    print(json.dumps({"active": True, "cases": cases, "default_split": default_split}))
    """
)


def test_decode_gemm_matches_float64_and_rows_and_threads_do_not_change_its_bits(tmp_path):
    seed = int(_seed.rng().integers(1 << 31))
    print(f"random seed {seed}")
    out = tmp_path / "decode.npz"
    p = _run(_DECODE, str(seed), str(out))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout.strip().splitlines()[-1])
    if not info["active"]:
        pytest.skip(f"OpenBLAS route unavailable here: {info['reason']}")
    assert info["default_split"] is not None and info["default_split"] > 0
    r = dict(np.load(out))
    eps32 = float(np.finfo(np.float32).eps)
    cpu = open("/proc/cpuinfo").read()
    has_fma = "avx2" in cpu and " fma" in cpu
    for i, case in enumerate(info["cases"]):
        x, w, c, m = r[f"x{i}"], r[f"w{i}"], r[f"c{i}"], case["m"]
        what = f"case {case}"
        takes = has_fma and m <= 64 and case["n"] * case["k"] > 1
        assert case["small"] == int(takes), what
        for key in ("one", "two", "alone"):
            assert _within_gemm_error(r[f"{key}{i}"], x, w.T, eps32), (key, what)
        if takes:
            # Bit for bit: one thread or two, a row alone or among any rows.
            np.testing.assert_array_equal(r[f"two{i}"], r[f"one{i}"], err_msg=what)
            np.testing.assert_array_equal(r[f"alone{i}"], r[f"one{i}"], err_msg=what)
            lo = case["lo"]
            np.testing.assert_array_equal(r[f"part{i}"], r[f"one{i}"][lo : lo + len(r[f"part{i}"])], err_msg=what)
            # One split product at most (with the threshold at 0), and none
            # narrower than one tile of columns.
            assert case["split"] <= (case["n"] >= 24), what
        a, b = case["alpha"], case["beta"]
        exact = b * c.astype(np.float64) + a * (x.astype(np.float64) @ w.T.astype(np.float64))
        bound = 2 * (x.shape[1] + 2) * eps32 * (abs(b) * np.abs(c) + abs(a) * (np.abs(x).astype(np.float64) @ np.abs(w).T))
        assert np.all(np.abs(r[f"mm{i}"] - exact) <= bound + 1e-30), what
    assert info["cases"][0]["split"] == int(has_fma)  # the large weight did use two threads


def test_gemm_knobs_reject_bad_values_naming_the_argument():
    from mtplx_ext import _blas

    with pytest.raises(ValueError, match="kernel"):
        _blas.set_gemm_kernel("fastest")
    with pytest.raises(ValueError, match="nbytes"):
        _blas.set_gemm_split_bytes(-1)
    with pytest.raises(ValueError, match="nbytes"):
        _blas.set_gemm_split_bytes(True)
    with pytest.raises(ValueError, match="rows"):
        _blas.set_small_gemm_rows(-3)
