"""The OpenAI API's edges on a live server (127.0.0.1): usage in streams only when asked, JSON 404 / 405,
`/v1/models/{id}`, unsupported fields refused by name, tool loops through the template, x-api-key."""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest
import _seed

openai = pytest.importorskip("openai")

from _serve import KEY  # noqa: E402

from mtplx_ext.serve import load_chat_tokenizer  # noqa: E402
from mtplx_ext.shipped import SHIPPED_MODEL  # noqa: E402

MODEL = "tiny-qwen3-mtp"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(live_server):
    base, key = live_server
    assert key == KEY
    return base


def _client(base: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _submitted(base: str) -> int:
    return httpx.get(base + "/metrics.json", headers=H, timeout=30).json()["submitted"]


def test_stream_usage_is_a_final_chunk_with_empty_choices_only_when_asked(server):
    client = _client(server)
    rng = _seed.rng()
    n = int(rng.integers(3, 12))
    prompt = "def " + "".join(rng.choice(list("abcdefgh"), 5)) + "(x):"
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    msgs = [{"role": "user", "content": prompt}]
    ref_chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0)
    for route, want in (("completion", ref), ("chat", ref_chat)):
        create = client.completions.create if route == "completion" else client.chat.completions.create
        kw = dict(prompt=prompt) if route == "completion" else dict(messages=msgs)
        plain = list(create(model=MODEL, max_tokens=n, temperature=0, stream=True, **kw))
        assert all(c.usage is None for c in plain) and all(c.choices for c in plain), route
        asked = list(create(model=MODEL, max_tokens=n, temperature=0, stream=True,
                            stream_options={"include_usage": True}, **kw))
        *body, last = asked
        assert last.choices == [] and all(c.choices and c.usage is None for c in body), route
        assert last.usage.model_dump() == want.usage.model_dump(), route
        text = "".join((c.choices[0].text if route == "completion" else c.choices[0].delta.content) or ""
                       for c in body)
        assert text == (want.choices[0].text if route == "completion" else want.choices[0].message.content)
    r = httpx.post(server + "/v1/completions", headers=H, timeout=30,
                   json={"prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_unknown_routes_and_methods_get_json_404_and_405(server):
    for method, path, status in (("GET", "/nope", 404), ("POST", "/v1/engines", 404), ("GET", "/v1/chat/completions", 405),
                                 ("DELETE", "/v1/models", 405), ("GET", "/v1/messages", 405)):
        r = httpx.request(method, server + path, headers=H, timeout=30)
        assert r.status_code == status, (method, path, r.text)
        body = r.json()
        msg = body["error"]["message"]
        assert path in msg and (body.get("type") == "error") == path.startswith("/v1/messages")
    assert "POST" in httpx.get(server + "/v1/completions", headers=H, timeout=30).headers["allow"]


def test_models_by_id(server):
    client = _client(server)
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-" + os.urandom(3).hex())


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "n", 2),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "return x"),
    ("/v1/completions", "logprobs", 21),
    ("/v1/completions", "logit_bias", {"eleven": 5}),
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "n", 3),
    ("/v1/chat/completions", "logprobs", "yes"),
    ("/v1/chat/completions", "top_logprobs", 99),
    ("/v1/chat/completions", "response_format", {"type": "yaml"}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f g"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "parallel_tool_calls", "yes"),
])
def test_unsupported_fields_get_a_400_naming_them_and_never_reach_the_engine(server, path, field, value):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    body[field] = value
    before = _submitted(server)
    r = httpx.post(server + path, json=body, headers=H, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split("[")[0].split(".")[0] == field
    assert _submitted(server) == before


def test_the_no_op_values_of_unimplemented_fields_are_accepted(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 1, "logprobs": False,
            "response_format": {"type": "text"}, "logit_bias": {}, "store": False, "user": "u", "metadata": {"a": "b"}}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text


def test_a_tool_loop_with_null_content_goes_through_the_template(server):
    client = _client(server)
    rng = _seed.rng()
    result = str(int(rng.integers(0, 10**6)))
    args = {"path": "/etc/" + os.urandom(2).hex()}
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "def read(path):"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "read", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # The shipped template joins the texts: the prompt is what it renders (mlx-lm's wrapper as the oracle).
    oracle = [msgs[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "read", "arguments": args}}]}, msgs[2]]
    text = load_chat_tokenizer(SHIPPED_MODEL).apply_chat_template(oracle, tools=tools, tokenize=False,
                                                                  add_generation_prompt=True)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json")).encode(text).ids
    assert r.usage.prompt_tokens == len(ids) and result in text


def test_x_api_key_is_accepted_beside_the_bearer_token(server):
    body = {"prompt": "import os", "max_tokens": 2}
    assert httpx.post(server + "/v1/completions", json=body, headers={"x-api-key": KEY}, timeout=60).status_code == 200
    r = httpx.post(server + "/v1/completions", json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_per_request_mtp_depth_keeps_greedy_tokens_and_is_honoured(server):
    client = _client(server)
    rng = _seed.rng()
    prompt = "class Stack:\n    def __init__(self):" + " " * int(rng.integers(0, 3))
    n = int(rng.integers(16, 32))
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    assert full.model_extra["mtp"]["depth"] == 2
    for depth in (0, 1):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"mtp": {"depth": depth}})
        mtp = r.model_extra["mtp"]
        assert r.choices[0].text == full.choices[0].text
        assert mtp["depth"] == depth and mtp["accepted_drafts"] <= depth * mtp["cycles"]
        # Each cycle commits at most depth + 1 tokens (the prefill commits the first).
        assert r.usage.completion_tokens <= 1 + (depth + 1) * mtp["cycles"]
    off = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=n,
                                         temperature=0, extra_body={"mtp": False})
    assert off.model_extra["mtp"]["accepted_drafts"] == 0 and off.model_extra["mtp"]["depth"] == 0
    for bad in ({"depth": 3}, {"depth": -1}, {"depth": "1"}, {"k": 1}, 2):
        r = httpx.post(server + "/v1/completions", json={"prompt": "x", "mtp": bad}, headers=H, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("mtp"), (bad, r.text)
