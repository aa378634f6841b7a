"""One live `mtplx-ext serve` (shipped model, depth 2, an API key) shared by the API test modules."""

from __future__ import annotations

import pytest
from _live_server import start, stop
from _serve import KEY


@pytest.fixture(scope="session")
def live_server():
    """(base URL, API key) of the shared server; it must exit with status 0 at the end."""
    proc, base = start("--api-key", KEY, "--max-batch", "4", "--depth", "2")
    yield base, KEY
    assert stop(proc) == 0
