"""A bounded soak of one server on the shipped model (127.0.0.1): 300 requests of random kinds.

Streamed or not, completions and chat, greedy / sampled / with penalties,
with stop strings, clients that go away at random times, and a few
malformed bodies, all at once from a pool of clients. Every request is
answered (or refused, for the malformed ones) or cancelled; afterwards no
row, KV slot or waiting request is left and the server's resident memory
grew by less than `RSS_BOUND` past its first requests.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time

import httpx

from _live_server import metrics, rss_bytes, start, stop, wait_idle
import _seed

N, CLIENTS, WARM = 300, 12, 60
#: Resident memory the server may gain over the soak after its first WARM requests (KV, caches and
#: allocator slack of a model whose whole KV for a full batch is a few MiB; the prefix cache is capped at 16 MiB).
RSS_BOUND = 64 << 20
MALFORMED = [
    b'{"prompt": "x", "max_tokens": "many"}',
    b'{"prompt": "def \\ud800 f(", "max_tokens": 4}',
    b'{"messages": [{"role": "banana", "content": "x"}]}',
    b'{"prompt": "x", "temperature": -1}',
    b"[" * 5000 + b"]" * 5000,
    b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}",
    b"{not json",
]
SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
            "for i in range(10):", "    if not isinstance(", "try:\n    import", "# helpers\n"]


def _job(rng: random.Random) -> dict:
    u = rng.random()
    kind = "malformed" if u < 0.06 else ("disconnect" if u < 0.2 else "ok")
    chat = rng.random() < 0.3
    body: dict = {"max_tokens": rng.randint(1, 48), "stream": rng.random() < 0.5}
    if body["stream"]:  # streams carry usage only when asked, as OpenAI's
        body["stream_options"] = {"include_usage": True}
    text = rng.choice(SNIPPETS) * rng.randint(1, 3)
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    s = rng.random()
    if s < 0.4:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.uniform(0.5, 1.2), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**31))
        if s > 0.8:
            body["frequency_penalty"] = 0.4
    if rng.random() < 0.25:
        body["stop"] = rng.sample(["\n\n", "return", ":", "(", "self"], rng.randint(1, 2))
    if kind == "malformed":
        return {"kind": kind, "path": "/v1/completions", "raw": rng.choice(MALFORMED)}
    return {"kind": kind, "path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
            "after": rng.uniform(0.005, 0.3), "chunks": rng.randint(0, 4)}


def _run(base: str, job: dict) -> str:
    """What happened: "ok", "refused" or "gone"; raises on anything else."""
    url = base + job["path"]
    if job["kind"] == "malformed":
        r = httpx.post(url, content=job["raw"], headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        return "refused"
    body, gone = job["body"], job["kind"] == "disconnect"
    if not body["stream"]:
        try:
            r = httpx.post(url, json=body, timeout=job["after"] if gone else 60)
        except httpx.TimeoutException:
            assert gone
            return "gone"
        assert r.status_code == 200, r.text
        out = r.json()
        _check(out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"], body)
        return "ok"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        data = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(line[len("data: "):])
                if gone and len(data) > job["chunks"]:
                    return "gone"  # leaves the stream without reading on
    assert data[-1] == "[DONE]", data
    last, usage = json.loads(data[-3]), json.loads(data[-2])  # include_usage: usage in a chunk of its own
    assert usage["choices"] == [], usage
    _check(last["choices"][0]["finish_reason"], usage["usage"]["completion_tokens"], body)
    return "ok"


def _check(finish: str, n: int, body: dict) -> None:
    assert finish in ("stop", "length") and 1 <= n <= body["max_tokens"], (finish, n, body)
    if finish == "length":
        assert n == body["max_tokens"], (n, body)


def test_soak_of_300_mixed_requests_leaves_nothing_behind_and_memory_bounded():
    rng = random.Random(_seed.fresh())
    jobs = [_job(rng) for _ in range(N)]
    proc, base = start("--max-batch", "8", "--prefix-cache-mb", "16")
    try:
        t0 = time.time()
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            first = list(pool.map(lambda j: _run(base, j), jobs[:WARM]))
            wait_idle(base)
            rss0 = rss_bytes(proc.pid)
            rest = list(pool.map(lambda j: _run(base, j), jobs[WARM:]))
        took = time.time() - t0
        m = wait_idle(base)
        rss1 = rss_bytes(proc.pid)
    finally:
        code = stop(proc)
    outcomes = first + rest
    assert code == 0
    reached = sum(j["kind"] != "malformed" for j in jobs)
    assert outcomes.count("refused") == N - reached
    # A client meant to go away may get its whole answer first.
    assert outcomes.count("ok") + outcomes.count("gone") == reached
    assert outcomes.count("gone") <= sum(j["kind"] == "disconnect" for j in jobs)
    assert m["live_streams"] == 0 and m["kv_slots"] == 0 and m["waiting"] == 0, m
    assert m["submitted"] == reached and m["failed"] == 0, m
    assert m["finished"] + m["cancelled"] == reached, m
    assert m["cancelled"] <= outcomes.count("gone"), m
    assert rss1 - rss0 < RSS_BOUND, (rss0 >> 20, rss1 >> 20)
    print(f"soak: {N} requests in {took:.1f} s, {m['cancelled']} cancelled of {outcomes.count('gone')} gone, "
          f"RSS {rss0 >> 20} -> {rss1 >> 20} MiB")
