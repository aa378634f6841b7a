"""Starting and stopping `mtplx-ext serve` on 127.0.0.1 for the serve tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import mtplx_ext

PYTHON_DIR = str(Path(mtplx_ext.__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*flags: str, timeout: float = 60) -> tuple[subprocess.Popen, str]:
    """A server subprocess on a free 127.0.0.1 port and its base URL, once /health answers."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "mtplx_ext.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read().decode()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not come up in {timeout} s")


def stop(proc: subprocess.Popen) -> int:
    """SIGINT, then the exit status (killed after 30 s)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
