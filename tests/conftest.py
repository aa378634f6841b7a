import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Each worker process of a parallel run (pytest-xdist) gets a temp directory
# of its own before anything compiles: MLX's CPU backend keeps the kernels it
# compiles under <tmp>/mlx/, and tests that count the kernels a decode builds
# must see their own process's only. Subprocesses inherit it.
# Kernels a sibling worker finished are linked in before each test (`_kernel_share`).
_TMP_PREFIX = "mtplx-tests-"
_own_tmp = None
if os.environ.get("PYTEST_XDIST_WORKER"):
    _own_tmp = os.path.join(tempfile.gettempdir(), _TMP_PREFIX + os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(_own_tmp, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = _own_tmp

import mtplx_ext  # noqa: E402, F401  (before mlx.core: loads the fast BLAS)

# Helpers shared by test modules (tests/_*.py) import as plain modules, and
# so does the Metal emulator tool (tests/tools/metal_shim).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tools"))


import pytest  # noqa: E402

import _compiler_shim  # noqa: E402
import _kernel_share  # noqa: E402
import _seed  # noqa: E402

# Decided once, before pytest-xdist starts its workers: they inherit it.
SESSION_SEED = _seed.session_seed()


# Once, in the process that starts the workers (they and every subprocess inherit PATH): MLX's fused
# kernels compile against a precompiled header (`_compiler_shim`).
# The header's folder (about 100 MB) is removed when this process exits, after the workers.
_PCH = None
if not os.environ.get("PYTEST_XDIST_WORKER"):
    _pch_dir = tempfile.mkdtemp(prefix="mtplx-tests-pch-")
    atexit.register(shutil.rmtree, _pch_dir, ignore_errors=True)
    _PCH = _compiler_shim.install(Path(_pch_dir))


def pytest_report_header(config):
    lines = [f"test seed: {SESSION_SEED} (replay: {_seed.ENV}={SESSION_SEED}; new cases: {_seed.ENV}=fresh)"]
    return lines + ([_PCH] if _PCH else [])


def pytest_configure(config):
    # Hypothesis draws its examples from the run seed too (its own --hypothesis-seed, set for it).
    try:
        from hypothesis import core
    except ImportError:
        return
    if getattr(config.option, "hypothesis_seed", None) is None:
        core.global_force_seed = SESSION_SEED


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _own_tmp is not None:  # kernels the other workers compiled (`_kernel_share`)
        _kernel_share.take_siblings_kernels(_own_tmp, _TMP_PREFIX)


@pytest.fixture(autouse=True)
def _test_seed(request):
    """Seeds every generator a test may use from (run seed, test id): NumPy's and Python's global
    generators, MLX's default key, and `_seed.fresh()` / the `rng` fixture."""
    _seed_globals(_seed.start(request.node.nodeid))
    yield


def _seed_globals(seed: int) -> None:
    import random

    import mlx.core as mx
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    mx.random.seed(seed % 2**32)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    # Wider fixtures (models built once per module or session) draw from their own seed.
    if fixturedef.scope != "function":
        _seed_globals(_seed.start(fixturedef.scope, request.node.nodeid, fixturedef.argname))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(
            ("replay", f"{_seed.ENV}={SESSION_SEED} python -m pytest '{item.nodeid}'"))


@pytest.fixture(scope="session")
def emu(request, tmp_path_factory):
    """The Metal threadgroup emulator's library, compiled once per session.

    Kept in pytest's cache when it has one (the build is keyed by its inputs),
    else in a session temp folder; skips where clang++ is missing.
    """
    from pathlib import Path

    from metal_shim import emulator

    if emulator.clang() is None:
        pytest.skip("clang++ not installed: the Metal emulator needs it (Debian: apt-get install clang)")
    cache = getattr(request.config, "cache", None)
    root = cache.mkdir("metal_emulator") if cache else tmp_path_factory.mktemp("emu")
    return emulator.Emulator(emulator.build(Path(root)))


@pytest.fixture()
def rng():
    """The test's generator: new inputs with each run seed, the same ones when a seed is replayed."""
    import numpy as np

    return np.random.default_rng(_seed.fresh())


@pytest.fixture(scope="module")
def shipped():
    """The trained model shipped inside the package."""
    from mtplx_ext.shipped import SHIPPED_MODEL

    return mtplx_ext.load(SHIPPED_MODEL)
