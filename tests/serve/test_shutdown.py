"""SIGTERM / SIGINT under streaming load: a bounded grace period, streams ended with an error event, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from _live_server import metrics, spawn, wait_ready

GRACE = 1.5
ROUNDS, SERVERS = 10, 2  # 20 shutdowns, two servers at a time
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


def test_twenty_shutdowns_under_streaming_load_end_the_streams_and_exit_0_within_the_grace_period():
    for rnd in range(ROUNDS):
        servers = [spawn("--max-batch", "4", "--depth", "1", "--prefix-cache-mb", "0",
                         "--shutdown-grace", str(GRACE)) for _ in range(SERVERS)]
        for proc, base in servers:
            wait_ready(proc, base)
        loads = []
        for _, base in servers:
            long = [{} for _ in range(3)]
            threads = [threading.Thread(target=_stream, args=(base, LONG, o)) for o in long]
            for t in threads:
                t.start()
            loads.append((long, threads))
        for _, base in servers:  # the long streams decode
            deadline = time.time() + 30
            while metrics(base)["live_streams"] < 3 and time.time() < deadline:
                time.sleep(0.02)
        # A short stream in flight at the signal finishes within the grace period.
        for (_, base), (long, threads) in zip(servers, loads):
            short = {}
            threads.append(threading.Thread(target=_stream, args=(base, 8, short)))
            threads[-1].start()
            long.append(short)
        for _, base in servers:  # ... once it was submitted
            deadline = time.time() + 30
            while metrics(base)["submitted"] < 4 and time.time() < deadline:
                time.sleep(0.005)
        sig = signal.SIGTERM if rnd % 2 == 0 else signal.SIGINT
        sent = time.time()
        for proc, _ in servers:
            proc.send_signal(sig)
        for (proc, _), (outs, threads) in zip(servers, loads):
            try:
                code = proc.wait(timeout=GRACE + 10)
            finally:
                if proc.poll() is None:
                    proc.kill()
            took = time.time() - sent
            for t in threads:
                t.join(30)
            log = proc.stdout.read().decode()
            assert code == 0, (rnd, sig, log)
            assert took <= GRACE + 1.0, (rnd, took)
            assert "Traceback" not in log and "Event loop is closed" not in log and "terminate" not in log, log
            *long, short = outs
            assert all(o.get("status") == 200 and _ended_with_an_error_event(o) for o in long), (rnd, long)
            assert _finished(short), (rnd, short)
