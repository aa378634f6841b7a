"""The watchdog ends a rank whose peers stopped answering, with one line and status 3, in bounded time."""

from __future__ import annotations

import subprocess
import sys
import time

from _dist import PYTHON_DIR

# Beats for 2 s, every beat well inside the 1 s timeout (it must not fire), then
# hangs as in a collective that never returns (it must fire within the timeout
# plus its polling step).
SCRIPT = """
import time
from mtplx_ext.batching.collective import Watchdog
dog = Watchdog(1.0, rank=1)
for _ in range(10):
    time.sleep(0.2)
    dog.beat()
print("alive", flush=True)
print("hang", time.time(), flush=True)
time.sleep(30)
print("not reached", flush=True)
"""


def test_no_heartbeat_for_the_timeout_exits_with_one_clear_line_and_beats_keep_it_alive():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": PYTHON_DIR, "PATH": ""})
    ended = time.time()
    assert p.returncode == 3, p.stderr
    assert "alive" in p.stdout and "not reached" not in p.stdout
    hang = float(next(l for l in p.stdout.splitlines() if l.startswith("hang")).split()[1])
    assert ended - hang < 10
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("mtplx-ext: error: rank 1: no answer from the other ranks for ")
