"""A live `mtplx-ext serve` on 127.0.0.1 for the server tests: start, stop, metrics, raw HTTP/1.1."""

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


def spawn(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Starts the server (not waiting for it); its stdout and stderr go to one pipe."""
    port = free_port()
    env = dict(env or os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtplx_ext.cli", "serve", "--port", str(port), *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, base: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read().decode()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server did not come up in {timeout} s")


def start(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc, base = spawn(*flags, env=env)
    wait_ready(proc, base)
    return proc, base


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 30) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def metrics(base: str, key: str | None = None) -> dict:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(base + "/metrics.json", headers=h, timeout=30).json()


def wait_idle(base: str, key: str | None = None, timeout: float = 30) -> dict:
    """The metrics once no row, KV slot or waiting request is left (or at the timeout)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base, key)
        if (m["live_streams"] == 0 and m["kv_slots"] == 0 and m["waiting"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.02)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
