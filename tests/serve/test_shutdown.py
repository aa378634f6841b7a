"""SIGTERM / SIGINT under streaming load: a bounded grace period, streams ended with an error event, exit 0.

Twenty shutdowns run `serve` in this process (the signal is real, sent to
this process while its main thread serves), so they cost no interpreter
start each; three more run `mtplx-ext serve` as its own process for the
exit status (the server tests' only restarts of the process).
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import json
import os
import signal
import threading
import time

import httpx
import pytest

import mtplx_ext
from mtplx_ext.serve import serve
from mtplx_ext.serve.server import bind
from mtplx_ext.shipped import SHIPPED_MODEL

from _live_server import metrics, spawn, start, stop, wait_ready

GRACE = 0.5  # seconds: far more than the short request in flight at the signal needs to finish
LONG = 3000  # tokens: far more than the grace period decodes


def _stream(base: str, max_tokens: int, out: dict) -> None:
    body = {"prompt": "def main():", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            out["lines"] = [line for line in r.iter_lines() if line]
    except httpx.HTTPError as e:  # a cut connection
        out["exception"] = repr(e)


def _ended_with_an_error_event(out: dict) -> bool:
    lines = out.get("lines", [])
    if len(lines) < 2 or lines[-1] != "data: [DONE]":
        return False
    last = json.loads(lines[-2][len("data: "):])
    return "shutting down" in last.get("error", {}).get("message", "")


def _finished(out: dict) -> bool:
    lines = out.get("lines", [])
    if len(lines) < 2 or lines[-1] != "data: [DONE]":
        return False
    choices = json.loads(lines[-2][len("data: "):]).get("choices") or [{}]
    return choices[0].get("finish_reason") == "length"


def _load(base: str) -> tuple[list[dict], list[threading.Thread]]:
    """Three long streams decoding and a short one submitted, on `base`."""
    outs = [{} for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(base, LONG if i < 3 else 8, o)) for i, o in enumerate(outs)]
    for t in threads[:3]:
        t.start()
    _until(base, "live_streams", 3)
    threads[3].start()  # in flight at the signal, it finishes within the grace period
    _until(base, "submitted", 4)
    return outs, threads


def _until(base: str, key: str, n: int) -> None:
    deadline = time.time() + 60
    while metrics(base)[key] < n:
        assert time.time() < deadline, (key, n)
        time.sleep(0.005)


def _check_streams(outs: list[dict]) -> None:
    *long, short = outs
    assert all(o.get("status") == 200 and _ended_with_an_error_event(o) for o in long), long
    assert _finished(short), short


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED_MODEL)


def test_twenty_signals_under_streaming_load_end_the_streams_and_return_within_the_grace_period(shipped):
    # The server runs in this process, whose heap holds what earlier tests left: a full collection over
    # it (about 0.4 s, more in a long run) would stall the server as `mtplx-ext serve`'s own process is
    # not stalled (it freezes its startup objects). Frozen here too, for the measurement.
    gc.freeze()
    errors: list[str] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(f"{a.thread.name}: {a.exc_type.__name__}: {a.exc_value}")
    try:
        for rep in range(20):
            sock = bind("127.0.0.1", 0)
            base = f"http://127.0.0.1:{sock.getsockname()[1]}"
            sig = signal.SIGTERM if rep % 2 == 0 else signal.SIGINT
            sent: list[float] = []
            outs_threads: list = []

            def client() -> None:  # the load, then the signal (sent whatever happened, so serve returns)
                try:
                    deadline = time.time() + 60
                    while time.time() < deadline:
                        try:
                            if httpx.get(base + "/health", timeout=1).status_code == 200:
                                break
                        except httpx.HTTPError:
                            time.sleep(0.02)
                    outs_threads.append(_load(base))
                finally:
                    sent.append(time.time())
                    os.kill(os.getpid(), sig)

            lines: list[str] = []
            driver = threading.Thread(target=client)
            driver.start()
            serve(shipped, SHIPPED_MODEL, sock=sock, max_batch=4, depth=1, prefix_cache_bytes=0,
                  shutdown_grace=GRACE, warm=rep == 0, log=lines.append)
            took = time.time() - sent[0]
            driver.join(30)
            assert outs_threads, "the load did not start"
            outs, threads = outs_threads[0]
            for t in threads:
                t.join(30)
            assert took <= GRACE + 1.0, (rep, took)
            _check_streams(outs)
            assert not errors, errors
    finally:
        threading.excepthook = old_hook
        gc.unfreeze()


def test_a_server_process_started_and_stopped_many_times_exits_0_cleanly_and_within_the_grace_period_on_either_signal():
    # The process's own ending: SIGTERM and SIGINT under streaming load (it exits 0 within the grace period
    # plus a second, the streams ended as above), then a server on the default flags stopped after a
    # request finished and with another in flight (it exits 0, cleanly).
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc, base = spawn("--max-batch", "4", "--depth", "1", "--prefix-cache-mb", "0",
                           "--shutdown-grace", str(GRACE))
        wait_ready(proc, base)
        outs, threads = _load(base)
        sent = time.time()
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=GRACE + 10)
        finally:
            if proc.poll() is None:
                proc.kill()
        took = time.time() - sent
        for t in threads:
            t.join(30)
        log = proc.stdout.read().decode()
        assert code == 0, (sig, log)
        assert took <= GRACE + 1.0, (sig, took)
        assert "Traceback" not in log and "Event loop is closed" not in log and "terminate" not in log, log
        _check_streams(outs)
    proc, base = start("--max-batch", "4")
    assert httpx.post(base + "/v1/completions", json={"prompt": "import os", "max_tokens": 4},
                      timeout=60).status_code == 200
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, base + "/v1/completions",
                          json={"prompt": "import os", "max_tokens": 200, "temperature": 0}, timeout=60)
        time.sleep(0.3)
        code = stop(proc)
        try:
            fut.result()
        except httpx.HTTPError:
            pass
    log = proc.stdout.read().decode()
    assert code == 0, log
    assert "Traceback" not in log and "Abort" not in log, log
