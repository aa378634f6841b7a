"""The live server the API test modules share: the shipped model at depth 2 with an API key, in this process.

`LiveServer` (tests/_serve.py) is `mtplx-ext serve FLAGS` without its own
process: the CLI's flags, model and settings, `serve`'s engine and warm-up,
uvicorn on 127.0.0.1. Its engine runs only while its module's tests do (an
engine patches mlx-lm's ops process-wide while it runs); starting one costs
a warm-up (well under a second), not an interpreter, a model load and a
warm-up as a subprocess does.
"""

from __future__ import annotations

import pytest
from _serve import KEY, LiveServer

#: `mtplx-ext serve` flags of the shared server.
FLAGS = ("--api-key", KEY, "--max-batch", "4", "--depth", "2")


@pytest.fixture(scope="module")
def live_server():
    """(base URL, API key) of the shared server; it must shut down cleanly at the end."""
    with LiveServer(*FLAGS) as s:
        yield s.base, KEY
