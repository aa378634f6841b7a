"""The CPU kernels' worker pool: results do not depend on the thread count.

Rows of sample_tokens / verify_sampled run on a persistent pool sized by
MTPLX_CPU_THREADS. These tests switch the count in-process through the
internal `threads.set_cpu_threads(n)` (0 restores the environment's value) and
check the environment variable itself in subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.sampling import SamplerConfig
from mtplx_ext.ops import threads
from test_sampling_fused import DTYPES, random_config, random_counts, random_logits
import _seed

PYTHON_DIR = str(Path(mtplx_ext.__file__).resolve().parent.parent)
THREADS = (1, 2, 3)


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


@pytest.fixture(autouse=True)
def _restore_thread_count():
    yield
    threads.set_cpu_threads(0)


def _inputs(rng, B: int, V: int, dtype, *, sparse_only: bool = False):
    vl = random_logits(rng, (B, 2, V), dtype)
    # Half the drafts near the target (acceptances), half unrelated.
    near = mx.array(rng.random((B, 1)) < 0.5)
    noise = random_logits(rng, (B, V), dtype)
    dl = mx.where(near, (vl[:, 0].astype(mx.float32) + 0.3 * noise.astype(mx.float32)).astype(dtype), noise)
    counts = random_counts(rng, B, V)
    if sparse_only:
        cfgs = [SamplerConfig(temperature=0.7, top_k=int(rng.choice([1, 20, 50])), top_p=0.8) for _ in range(B)]
    else:
        cfgs = [random_config(rng, V) for _ in range(B)]
    tokens = np.stack([rng.integers(V, size=B), rng.integers(V, size=B)], 1).astype(np.int32)
    u = rng.random((B, 4)).astype(np.float32)
    extra = rng.integers(-1, V, size=(B, 2)).astype(np.int32)
    mx.eval(vl, dl)
    return vl, dl, tokens, u, counts, cfgs, extra


def _run_both(vl, dl, tokens, u, counts, cfgs, extra):
    x = mtplx_ext.sample_tokens(
        dl, mx.array(u[:, 0]), cfgs, token_counts=mx.array(counts), extra_tokens=mx.array(extra)
    )
    v = mtplx_ext.verify_sampled(
        vl, dl, mx.array(tokens), mx.array(u[:, 1:]), cfgs, token_counts=mx.array(counts)
    )
    return np.array(x), np.array(v)


def _per_thread_count(args, *, pooled: bool = True) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Outputs per thread count; `pooled`: multi-thread runs must use the pool."""
    out = {}
    for n in THREADS:
        threads.set_cpu_threads(n)
        assert threads.cpu_threads() == n
        jobs = threads.cpu_pool_jobs()
        out[n] = _run_both(*args)
        used = threads.cpu_pool_jobs() - jobs
        if n == 1:
            assert used == 0
        elif pooled:
            assert used >= 1, n
    return out


def _assert_identical(out: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
    x1, v1 = out[1]
    for n in THREADS[1:]:
        assert np.array_equal(out[n][0], x1), n
        assert np.array_equal(out[n][1], v1), n


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_outputs_are_identical_for_1_2_and_3_threads_on_random_batches(rng, dtype):
    # Large enough that the pool is used (small jobs stay on one thread).
    for B, V in ((24, 4099), (16, 16411)):
        args = _inputs(rng, B, V, DTYPES[dtype])
        _assert_identical(_per_thread_count(args))


def test_outputs_are_identical_for_1_2_and_3_threads_at_full_vocabulary(rng):
    args = _inputs(rng, 8, 151936, mx.float32, sparse_only=True)
    out = _per_thread_count(args)
    _assert_identical(out)
    assert np.all(out[1][1][:, 3] >= 0)  # every row usable and decided


@pytest.mark.parametrize("B", [1, 3, 33])
def test_odd_batch_sizes_give_identical_outputs_for_every_thread_count(rng, B):
    args = _inputs(rng, B, 32768, mx.bfloat16)
    _assert_identical(_per_thread_count(args, pooled=B > 1))


def test_tiny_jobs_stay_on_the_calling_thread(rng):
    args = _inputs(rng, 8, 64, mx.float32)
    threads.set_cpu_threads(3)
    jobs = threads.cpu_pool_jobs()
    _run_both(*args)
    assert threads.cpu_pool_jobs() == jobs


def test_more_threads_than_rows_give_identical_outputs(rng):
    args = _inputs(rng, 2, 65536, mx.float16)
    out = {}
    for n in (1, 7):
        threads.set_cpu_threads(n)
        out[n] = _run_both(*args)
    assert np.array_equal(out[1][0], out[7][0]) and np.array_equal(out[1][1], out[7][1])


def test_concurrent_streams_share_the_pool_and_get_identical_outputs(rng):
    args = _inputs(rng, 12, 20011, mx.float32)
    vl, dl, tokens, u, counts, cfgs, _ = args
    threads.set_cpu_threads(1)
    ref = np.array(
        mtplx_ext.verify_sampled(vl, dl, mx.array(tokens), mx.array(u[:, 1:]), cfgs, token_counts=mx.array(counts))
    )
    threads.set_cpu_threads(2)
    streams = [mx.new_stream(mx.cpu) for _ in range(3)]
    for _ in range(20):
        outs = [
            mtplx_ext.verify_sampled(
                vl, dl, mx.array(tokens), mx.array(u[:, 1:]), cfgs, token_counts=mx.array(counts), stream=s
            )
            for s in streams
        ]
        mx.eval(*outs)
        for o in outs:
            assert np.array_equal(np.array(o), ref)


def test_set_cpu_threads_rejects_out_of_range_counts():
    for bad in (-1, 257):
        with pytest.raises(ValueError, match="thread count"):
            threads.set_cpu_threads(bad)


# ---- MTPLX_CPU_THREADS in fresh processes.


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = PYTHON_DIR + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("MTPLX_CPU_THREADS", None)
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "value, message",
    [
        ("zero", "must be a positive integer"),
        ("1.5", "must be a positive integer"),
        ("0", "must be >= 1"),
        ("-2", "must be >= 1"),
        ("100000", "must be <= 256"),
    ],
)
def test_bad_mtplx_cpu_threads_fails_import_with_a_clear_error(value, message):
    p = _run("import mtplx_ext", MTPLX_CPU_THREADS=value)
    assert p.returncode != 0
    assert "ValueError" in p.stderr and "MTPLX_CPU_THREADS" in p.stderr and message in p.stderr
    assert repr(value) in p.stderr


def test_mtplx_cpu_threads_sets_the_count_and_unset_uses_the_usable_cpus_up_to_8():
    code = "from mtplx_ext.ops import threads; print(threads.cpu_threads())"
    p = _run(code, MTPLX_CPU_THREADS=" 3 ")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "3"
    p = _run(code)  # unset
    assert p.returncode == 0, p.stderr
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    assert p.stdout.strip() == str(min(cpus, 8))
    p = _run(code, MTPLX_CPU_THREADS="")  # empty counts as unset
    assert p.returncode == 0 and p.stdout.strip() == str(min(cpus, 8))


_EXIT = textwrap.dedent(
    """
    import os, sys
    import mtplx_ext
    import mlx.core as mx
    import numpy as np
    from mtplx_ext.sampling import SamplerConfig

    B, V = 16, 151936
    rng = np.random.default_rng(0)
    vl = mx.array(rng.standard_normal((B, 2, V)).astype(np.float32))
    dl = mx.array(rng.standard_normal((B, V)).astype(np.float32))
    tok = mx.array(rng.integers(0, V, (B, 2)).astype(np.int32))
    u = mx.array(rng.random((B, 3)).astype(np.float32))
    out = mtplx_ext.verify_sampled(vl, dl, tok, u, SamplerConfig(temperature=1.0, top_p=0.95))
    mode = sys.argv[1] if len(sys.argv) > 1 else "{mode}"
    if mode == "eval":
        mx.eval(out)
    elif mode == "in_flight":
        mx.async_eval(out)  # the interpreter exits while the pool may be busy
    elif mode == "fork":
        mx.eval(out)
        pid = os.fork()
        if pid == 0:
            sys.exit(7)  # a normal interpreter exit in the child, pool unused
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
    print("bye")
    """
)


@pytest.mark.parametrize("mode", ["eval", "in_flight", "fork"])
def test_interpreter_exits_cleanly_after_threaded_kernels(mode):
    if mode == "fork" and not hasattr(os, "fork"):
        pytest.skip("no fork")
    p = _run(_EXIT.replace("{mode}", mode), MTPLX_CPU_THREADS="3")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("bye")
