"""The watchdog ends a rank whose peers stopped answering, with one line and status 3, in bounded time."""

from __future__ import annotations

import subprocess
import sys
import time

from _dist import PYTHON_DIR

SCRIPT = """
import time
from mtplx_ext.batching.collective import Watchdog
dog = Watchdog({timeout}, rank=1)
for _ in range({beats}):
    time.sleep(0.2)
    dog.beat()
time.sleep({hang})  # a collective that never returns
print("not reached")
"""


def _run(timeout: float, beats: int, hang: float) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(timeout=timeout, beats=beats, hang=hang)],
                       capture_output=True, text=True, timeout=60, env={"PYTHONPATH": PYTHON_DIR, "PATH": ""})
    return p, time.monotonic() - t


def test_no_heartbeat_for_the_timeout_exits_with_one_clear_line():
    p, took = _run(timeout=1.0, beats=10, hang=30)  # beats for 2 s (each well inside the timeout), then hangs
    assert p.returncode == 3, p.stderr
    assert "not reached" not in p.stdout
    assert p.stderr.strip().splitlines()[-1].startswith("mtplx-ext: error: rank 1: no answer from the other ranks")
    assert took < 25


def test_beats_inside_the_timeout_keep_the_rank_alive():
    p, _ = _run(timeout=1.0, beats=10, hang=0)
    assert p.returncode == 0 and "not reached" in p.stdout, p.stderr
