import os
import sys
import tempfile

# Each worker process of a parallel run (pytest-xdist) gets a temp directory
# of its own before anything compiles: MLX's CPU backend keeps the kernels it
# compiles under <tmp>/mlx/, and tests that count the kernels a decode builds
# must see their own process's only. Subprocesses inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _own_tmp = os.path.join(tempfile.gettempdir(), "mtplx-tests-" + os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(_own_tmp, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = _own_tmp

import mtplx_ext  # noqa: E402, F401  (before mlx.core: loads the fast BLAS)

# Helpers shared by test modules (tests/_*.py) import as plain modules, and
# so does the Metal emulator tool (tests/tools/metal_shim).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tools"))


import pytest  # noqa: E402


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
    """Fresh random inputs every run (a seed would make the test check one case forever)."""
    import numpy as np

    return np.random.default_rng()


@pytest.fixture(scope="module")
def shipped():
    """The trained model shipped inside the package."""
    from mtplx_ext.shipped import SHIPPED_MODEL

    return mtplx_ext.load(SHIPPED_MODEL)
