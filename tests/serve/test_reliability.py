"""`mtplx-ext serve` under clients that go away, odd bodies and loose headers (127.0.0.1 only; in this process:
tests/_serve.py)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

openai = pytest.importorskip("openai")

from _live_server import metrics  # noqa: E402
from _serve import LiveServer, cli_serve_args  # noqa: E402

KEY = "rel-key-" + os.urandom(4).hex()
MODEL = "tiny-qwen3-mtp"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with LiveServer("--api-key", KEY, "--max-batch", "4", "--depth", "2", "--max-body-mb", "1") as s:
        yield s.base


def _decoding(base: str, n: int, timeout: float = 20) -> dict:
    """The metrics once `n` rows decode."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(base, KEY)
        if m["live_streams"] >= n:
            return m
        time.sleep(0.01)
    raise AssertionError(f"{n} rows never decoded: {m}")


def _cancelled(base: str, want: int, timeout: float) -> tuple[dict, float]:
    """The metrics once `want` requests were cancelled and nothing is left decoding, and when."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base, KEY)
        if m["cancelled"] >= want and m["live_streams"] == 0 and m["kv_slots"] == 0:
            return m, time.time()
        if time.time() > deadline:
            raise AssertionError(f"not cancelled within {timeout} s: {m}")
        time.sleep(0.005)


def test_a_non_streaming_request_whose_client_closes_is_cancelled_at_once(server):
    before = metrics(server, KEY)
    body = json.dumps({"model": MODEL, "prompt": "def main():", "max_tokens": 4000, "temperature": 0}).encode()
    url = urlparse(server)
    s = socket.create_connection((url.hostname, url.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    _decoding(server, 1)
    s.close()
    closed_at = time.time()
    at_close = metrics(server, KEY)["generated_tokens"]
    m, when = _cancelled(server, before["cancelled"] + 1, timeout=3)
    # Cancelled within a few engine steps (a step here is a few ms and commits at most depth + 1 tokens a row).
    assert when - closed_at < 1.0
    assert m["generated_tokens"] - at_close < 200
    assert m["generated_tokens"] - before["generated_tokens"] < 4000 // 2
    assert m["finished"] == before["finished"] and m["failed"] == before["failed"]


def test_an_openai_client_that_times_out_and_retries_leaves_no_orphans(server):
    before = metrics(server, KEY)
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=0.4, max_retries=2)
    t0 = time.time()
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=MODEL, prompt="import os\n", max_tokens=4000, temperature=0)
    # Three attempts, each abandoned after 0.4 s: all three cancelled, none decoding on.
    m, _ = _cancelled(server, before["cancelled"] + 3, timeout=3)
    assert m["cancelled"] == before["cancelled"] + 3 and m["submitted"] == before["submitted"] + 3
    assert time.time() - t0 < 4000 / 2000 + 3  # far less than decoding 4000 tokens three times


def _raw(base: str) -> http.client.HTTPConnection:
    url = urlparse(base)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=30)


def _post(conn: http.client.HTTPConnection, path: str, raw: bytes) -> tuple[int, dict, bool]:
    conn.request("POST", path, body=raw, headers={**AUTH, "Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read()), resp.will_close


LONG = "9" * 5000
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "path,raw,param,needle",
    [
        ("/v1/completions", r'{"prompt": "def \ud800 f(", "max_tokens": 4}', "prompt", "surrogate"),
        ("/v1/completions", r'{"prompt": "x", "stop": ["ok", "\udfff"]}', "stop[1]", "surrogate"),
        ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \udc00"}]}', "messages[0].content",
         "surrogate"),
        ("/v1/chat/completions",
         r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud83d"}]}]}',
         "messages[0].content[0].text", "surrogate"),
        ("/v1/completions", r'{"prompt": "x", "\ud800": 1}', r"\ud800", "surrogate"),
        ("/v1/completions", DEEP, None, "nests too deeply"),
        ("/v1/completions", '{"prompt": ' + DEEP + "}", None, "nests too deeply"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": ' + LONG + "}", "max_tokens", "5000 digits"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": -' + LONG + "}", "max_tokens", "5000 digits"),
        ("/v1/completions", '{"prompt": "x", "seed": ' + LONG + "}", "seed", "5000 digits"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}, {"role": "banana", "content": "b"}]}',
         "messages[1].role", "banana"),
        ("/v1/completions", '{"prompt": "x", "temperature": -1}', "temperature", "temperature must be"),
        ("/v1/completions", '{"prompt": "x", "top_p": 2}', "top_p", "top_p must be"),
        ("/v1/completions", '{"prompt": "x", "top_k": 99999999}', "top_k", "top_k must be"),
        ("/v1/completions", '{"prompt": [1, 99999]}', "prompt", "prompt[1] = 99999 is outside the vocabulary"),
    ],
    ids=["surrogate-prompt", "surrogate-stop", "surrogate-chat", "surrogate-part", "surrogate-key", "deep-body",
         "deep-field", "long-max-tokens", "long-negative", "long-seed", "role", "temperature", "top-p", "top-k",
         "token-id"],
)
def test_odd_bodies_get_a_400_naming_the_field_and_the_connection_stays_usable(server, path, raw, param, needle):
    before = metrics(server, KEY)["submitted"]
    conn = _raw(server)
    status, err, closes = _post(conn, path, raw.encode())
    assert status == 400, err
    e = err["error"]
    assert needle in e["message"] and e["param"] == param and e["type"] == "invalid_request_error", e
    assert "SamplerConfig" not in e["message"] and "prompts[" not in e["message"] and "Traceback" not in e["message"]
    assert not closes
    sock = conn.sock
    status, ok, _ = _post(conn, "/v1/completions", b'{"prompt": "def f(", "max_tokens": 3, "temperature": 0}')
    assert status == 200 and ok["usage"]["completion_tokens"] == 3
    assert conn.sock is sock  # the same keep-alive connection answered
    conn.close()
    assert metrics(server, KEY)["submitted"] == before + 1  # only the good request reached the engine


def test_a_surrogate_pair_is_text_and_every_documented_role_is_accepted(server):
    # The escapes the checks above refuse, paired, are one character (U+1F600): not refused.
    conn = _raw(server)
    status, r, _ = _post(conn, "/v1/completions", rb'{"prompt": "x = \ud83d\ude00", "max_tokens": 2}')
    assert status == 200, r
    msgs = [{"role": role, "content": "hi"} for role in ("system", "developer", "user", "assistant", "tool", "user")]
    msgs[4]["tool_call_id"] = "call_0"  # a tool message answers a call
    status, r, _ = _post(conn, "/v1/chat/completions", json.dumps({"messages": msgs, "max_tokens": 2}).encode())
    assert status == 200, r
    conn.close()


def test_a_body_over_the_limit_gets_413_declared_or_chunked(server):
    before = metrics(server, KEY)["submitted"]
    big = json.dumps({"prompt": "x " * 800_000, "max_tokens": 2}).encode()  # 1.6 MB, the limit is 1 MiB
    r = httpx.post(server + "/v1/completions", content=big, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = httpx.post(server + "/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    # Under the limit the body is read and judged on its fields (here: the context).
    under = json.dumps({"prompt": "x " * 400_000, "max_tokens": 2}).encode()
    r = httpx.post(server + "/v1/completions", content=under, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert metrics(server, KEY)["submitted"] == before


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(server, scheme):
    r = httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={"Authorization": f"{scheme} {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    for bad in (f"{scheme} {KEY}x", f"{scheme}{KEY}", f"Basic {KEY}", KEY):
        r = httpx.post(server + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": bad}, timeout=30)
        assert r.status_code == 401, bad


def test_the_server_reports_its_warm_up_and_starts_its_counters_at_zero():
    # `serve` as `mtplx-ext serve` calls it, on this process's main thread, ended by a real SIGINT once the
    # metrics are read.
    import signal
    import threading

    from mtplx_ext.serve import serve
    from mtplx_ext.serve.server import bind

    sock = bind("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    got: dict = {}

    def client() -> None:  # the metrics once ready, then the signal (sent whatever happened, so serve returns)
        try:
            deadline = time.time() + 60
            while time.time() < deadline and "m" not in got:
                try:
                    got["m"] = metrics(base)
                except httpx.HTTPError:
                    time.sleep(0.02)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    lines: list[str] = []
    driver = threading.Thread(target=client)
    driver.start()
    runtime, folder, kwargs = cli_serve_args("--max-batch", "3", "--depth", "1", "--prefix-cache-mb", "8")
    serve(runtime, folder, **{**kwargs, "sock": sock, "log": lines.append})
    driver.join(30)
    out = "\n".join(lines)
    warm = [i for i, line in enumerate(lines) if line.startswith("mtplx-ext serve: warmed up in ")]
    ready = [i for i, line in enumerate(lines) if line.startswith("mtplx-ext serve: ready on http://127.0.0.1:")]
    assert warm and ready and warm[0] < ready[0], out
    assert "at batch 1 and 3" in lines[warm[0]]
    m = got["m"]
    assert all(m[k] == 0 for k in ("submitted", "finished", "cancelled", "failed", "generated_tokens", "cycles"))
    assert m["prefix_entries"] == 0 and m["prefix_lookups"] == 0
