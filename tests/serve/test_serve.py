"""`mtplx-ext serve` live on 127.0.0.1 (in this process: tests/_serve.py), driven by the official openai client.

Starting and stopping the server process: tests/serve/test_shutdown.py."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from pathlib import Path

import httpx
from _live_server import wait_idle
from _serve import LiveServer
import numpy as np
import pytest
import _seed

openai = pytest.importorskip("openai")

import mtplx_ext  # noqa: E402
from mtplx_ext import SamplerConfig  # noqa: E402
from mtplx_ext.batching import Engine  # noqa: E402
from mtplx_ext.serve import load_chat_tokenizer  # noqa: E402
from mtplx_ext.shipped import eos_ids  # noqa: E402
from mtplx_ext.shipped import SHIPPED_MODEL

KEY = "test-key-" + os.urandom(4).hex()
@pytest.fixture(scope="module")
def server():
    with LiveServer("--api-key", KEY, "--max-batch", "8", "--depth", "2") as s:
        yield s.base


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED_MODEL)


def _client(base: str, key: str = KEY) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=120, max_retries=0)


def _offline(rt, prompt_ids: list[int], max_tokens: int, sampler: SamplerConfig, seed: int | None, stop=()) -> str:
    """The same request decoded by an engine stepped here, alone."""
    eng = Engine(rt, max_batch=1, depth=2)
    r = eng.submit(prompt_ids, max_tokens=max_tokens, sampler=sampler, seed=seed, stop=stop,
                   stop_token_ids=eos_ids(rt.tokenizer))
    eng.run_until_idle()
    return r.text


def test_sixteen_concurrent_requests_all_complete_equal_to_the_offline_engine(server, shipped):
    rng = _seed.rng()
    snippets = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
                "for i in range(10):", "    if not isinstance(", "try:\n    import", "def main(argv):", "# helpers\n"]
    jobs = []
    for i in range(16):
        prompt = snippets[i % len(snippets)] * int(rng.integers(1, 4))
        temp = 0.0 if i % 2 == 0 else float(rng.uniform(0.5, 1.2))
        jobs.append(dict(prompt=prompt, max_tokens=int(rng.integers(4, 40)), temperature=temp,
                         top_p=0.95 if i % 4 == 1 else 1.0, frequency_penalty=0.3 if i % 4 == 3 else 0.0,
                         seed=int(rng.integers(0, 2**31)), stream=i % 3 == 0, chat=i % 5 == 0))
    client = _client(server)

    def run(job):
        kw = dict(model="tiny-qwen3-mtp", max_tokens=job["max_tokens"], temperature=job["temperature"],
                  top_p=job["top_p"], frequency_penalty=job["frequency_penalty"], seed=job["seed"])
        if job["chat"]:
            msgs = [{"role": "user", "content": job["prompt"]}]
            if job["stream"]:
                parts = list(client.chat.completions.create(messages=msgs, stream=True,
                                                            stream_options={"include_usage": True}, **kw))
                return "".join(c.choices[0].delta.content or "" for c in parts if c.choices), parts[-1].usage
            r = client.chat.completions.create(messages=msgs, **kw)
            return r.choices[0].message.content, r.usage
        if job["stream"]:
            parts = list(client.completions.create(prompt=job["prompt"], stream=True,
                                                   stream_options={"include_usage": True}, **kw))
            return "".join(c.choices[0].text for c in parts if c.choices), parts[-1].usage
        r = client.completions.create(prompt=job["prompt"], **kw)
        return r.choices[0].text, r.usage

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    # The server's engine shares this process: its last step (dropping the finished rows) ends before the
    # offline decodes start.
    m = wait_idle(server, KEY)
    chat_tok = load_chat_tokenizer(SHIPPED_MODEL)
    for job, (text, usage) in zip(jobs, results):
        text_in = job["prompt"]
        if job["chat"]:
            text_in = chat_tok.apply_chat_template([{"role": "user", "content": text_in}], tokenize=False,
                                                   add_generation_prompt=True)
        ids = shipped.tokenizer.encode(text_in).ids
        cfg = SamplerConfig(temperature=job["temperature"], top_p=job["top_p"],
                            frequency_penalty=job["frequency_penalty"])
        assert text == _offline(shipped, ids, job["max_tokens"], cfg, job["seed"]), job
        assert usage.prompt_tokens == len(ids) and 1 <= usage.completion_tokens <= job["max_tokens"]
    assert m["failed"] == 0 and m["live_streams"] == 0 and m["kv_slots"] == 0
    assert 0 < m["acceptance"] <= 1


def test_non_streaming_responses_carry_usage_and_mtp_statistics(server):
    r = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny-qwen3-mtp", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0},
                   timeout=60).json()
    assert r["usage"]["completion_tokens"] == 12 and r["choices"][0]["finish_reason"] == "length"
    assert r["mtp"]["depth"] == 2 and r["mtp"]["cycles"] >= 12 / 3
    assert 0 <= r["mtp"]["acceptance"] <= 1
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-qwen3-mtp"]


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b'{"model": "gpt-9", "prompt": "x"}', "unknown model"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', "max_tokens must be an integer"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens must be >= 1"),
        ("/v1/completions", b'{"prompt": "x", "temperature": -1}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "top_p": "high"}', "top_p must be a number"),
        ("/v1/completions", b'{"prompt": "x", "n": 2}', "n must be 1"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream must be a boolean"),
        ("/v1/completions", b'{"prompt": [1, 99999]}', "outside the vocabulary"),
        ("/v1/completions", b'{"prompt": "' + b"x = 1\\n" * 2000 + b'", "max_tokens": 8}', "exceeds the context"),
        ("/v1/chat/completions", b'{"messages": []}', "messages must be a non-empty list"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "content must be a string"),
    ],
)
def test_bad_requests_get_400_with_an_openai_error_body_and_never_reach_the_engine(server, path, body, needle):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    before = httpx.get(server + "/metrics.json", headers=h).json()["submitted"]
    r = httpx.post(server + path, content=body, headers=h, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(server + "/metrics.json", headers=h).json()["submitted"] == before


def test_missing_or_wrong_api_key_gets_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").completions.create(model="tiny-qwen3-mtp", prompt="x", max_tokens=2)
    assert httpx.get(server + "/health", timeout=30).status_code == 200


def test_a_client_that_drops_mid_stream_frees_its_row(server):
    h = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(server + "/metrics.json", headers=h).json()["cancelled"]
    body = {"prompt": "def main():", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=h, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(g.startswith("data: ") for g in got)
    deadline = time.time() + 30
    while time.time() < deadline:
        m = httpx.get(server + "/metrics.json", headers=h).json()
        if m["live_streams"] == 0 and m["cancelled"] > before:
            break
        time.sleep(0.1)
    assert m["live_streams"] == 0 and m["kv_slots"] == 0 and m["cancelled"] == before + 1


HYBRID = Path(__file__).resolve().parents[2] / "bench" / "models" / "tiny-qwen3-next-mtp"


@pytest.mark.skipif(not (HYBRID / "config.json").is_file(), reason="the trained hybrid model folder is not here")
def test_a_hybrid_model_folder_is_served_equal_to_the_offline_engine():
    # qwen3_next trunk (GatedDeltaNet + attention layers) with its MTP head.
    rng = _seed.rng()
    snippets = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "for i in"]
    jobs = [dict(prompt=s * int(rng.integers(1, 3)), max_tokens=int(rng.integers(4, 24)),
                 temperature=0.0 if i % 2 == 0 else 0.8, seed=int(rng.integers(0, 2**31)), stream=i % 3 == 0)
            for i, s in enumerate(snippets)]
    with LiveServer("--model", str(HYBRID), "--max-batch", "4", "--depth", "2") as served:
        client = _client(served.base)

        def run(job):
            kw = dict(model=HYBRID.name, prompt=job["prompt"], max_tokens=job["max_tokens"],
                      temperature=job["temperature"], seed=job["seed"])
            if job["stream"]:
                return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
            return client.completions.create(**kw).choices[0].text

        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            texts = list(pool.map(run, jobs))
        m = wait_idle(served.base)
    assert m["failed"] == 0 and m["live_streams"] == 0 and m["kv_slots"] == 0 and m["cycles"] > 0
    rt = mtplx_ext.load(HYBRID)
    for job, text in zip(jobs, texts):
        ids = rt.tokenizer.encode(job["prompt"]).ids
        assert text == _offline(rt, ids, job["max_tokens"], SamplerConfig(temperature=job["temperature"]), job["seed"]), job
