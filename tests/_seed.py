"""Test randomness that replays: every draw derives from one session seed and the test's id.

The session seed is printed in the run's header and in every failure report.
`MTPLX_TEST_SEED=<int>` replays a run; `MTPLX_TEST_SEED=fresh` (the default
outside CI) draws a new one, so repeated runs keep finding new cases; in CI
(`CI` set) a fixed seed makes the run reproducible. Each test's draws derive
from (session seed, test id) alone, so one failing test replays on its own
(`MTPLX_TEST_SEED=<seed> pytest <test id>`) in any order or worker.
"""

from __future__ import annotations

import hashlib
import os
import secrets

#: The session seed of CI runs (a fixed, arbitrary value).
CI_SEED = 20261205
ENV = "MTPLX_TEST_SEED"

_state = {"test": 0, "draws": 0}


def session_seed() -> int:
    """The run's seed: $MTPLX_TEST_SEED, else fixed under CI, else fresh (and then pinned in the environment)."""
    raw = os.environ.get(ENV, "").strip()
    if raw and raw != "fresh":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{ENV} must be an integer or 'fresh', got {raw!r}") from None
    seed = CI_SEED if os.environ.get("CI") and not raw else secrets.randbelow(2**31)
    os.environ[ENV] = str(seed)  # worker processes and subprocesses draw from the same run seed
    return seed


def derive(*parts: object) -> int:
    """A 63-bit seed from `parts` (stable across processes and Python versions)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def start(*scope: object) -> int:
    """Makes the seed of `scope` (a test's id; a fixture's scope, node and name) the current one and returns it.

    The conftest calls it before each test and before each module- or
    session-scoped fixture, so what a fixture draws does not depend on which
    test happened to set it up first.
    """
    _state["test"], _state["draws"] = derive(session_seed(), *scope), 0
    return _state["test"]


def rng() -> "np.random.Generator":
    """A NumPy generator seeded with the current test's next seed."""
    import numpy as np

    return np.random.default_rng(fresh())


def fresh() -> int:
    """The current test's next seed (a 30-bit int: fits every seed argument the package takes)."""
    _state["draws"] += 1
    return derive(_state["test"], _state["draws"]) % (1 << 30)
