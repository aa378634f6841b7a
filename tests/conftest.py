import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)
import os
import sys

# Helpers shared by test modules (tests/_*.py) import as plain modules.
sys.path.insert(0, os.path.dirname(__file__))


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
