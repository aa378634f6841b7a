"""Structured outputs through the official openai client against `mtplx-ext serve` on 127.0.0.1 (in this process:
tests/_serve.py).

`response_format` json_schema (strict) answers validate against their schema
(jsonschema), greedy and sampled, with MTP on (the response's `mtp` field
shows accepted drafts); json_object answers parse as JSON objects; a forced
tool call is the wrapper around a JSON call that validates against the
tool's parameters; bad schemas and formats get a 400 naming the field.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import _seed

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from _serve import LiveServer  # noqa: E402

from mtplx_ext.serve.tools import forced_call_schema, tool_format  # noqa: E402

#: The shipped tokenizer names no tool format: the Qwen-style JSON one, as the server parses it.
TOOL_CALL_START, TOOL_CALL_END = tool_format(None).prefix, tool_format(None).suffix

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},  # bounded: a sampled answer always ends
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "count", "ok", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["def parse(data):\n    return", "config = ", "class Point:\n    def to_json(self):\n        return"]


@pytest.fixture(scope="module")
def server():
    with LiveServer("--max-batch", "4", "--depth", "2") as s:
        yield s.base


def client(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_answers_validate_against_their_schema(server, temperature):
    rng = _seed.rng()
    c = client(server)
    for prompt in rng.choice(PROMPTS, size=2, replace=False):
        r = c.chat.completions.create(
            model="tiny-qwen3-mtp", messages=[{"role": "user", "content": str(prompt)}], max_tokens=200,
            temperature=temperature, seed=int(rng.integers(1 << 31)), response_format=json_schema_format(SCHEMA),
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_constrained_requests_keep_mtp_on(server):
    body = {"prompt": "x = ", "max_tokens": 120, "temperature": 0, "response_format": json_schema_format(SCHEMA)}
    r = httpx.post(server + "/v1/completions", json=body, timeout=120).json()
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)
    assert r["mtp"]["depth"] == 2 and r["mtp"]["accepted_drafts"] > 0


def test_json_object_answers_parse_as_json_objects(server):
    c = client(server)
    for prompt in PROMPTS[:2]:
        r = c.chat.completions.create(model="tiny-qwen3-mtp", messages=[{"role": "user", "content": prompt}],
                                      max_tokens=300, temperature=0, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # cut at max_tokens: still the start of a JSON object
            assert r.choices[0].message.content.startswith("{")


def test_a_forced_tool_call_is_a_valid_call_of_the_named_tool(server):
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    c = client(server)
    r = c.chat.completions.create(model="tiny-qwen3-mtp", messages=[{"role": "user", "content": "weather = "}],
                                  max_tokens=120, temperature=0, tools=tools,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = r.choices[0].message
    if msg.tool_calls:  # a server that parses the call out of the text
        call = {"name": msg.tool_calls[0].function.name, "arguments": json.loads(msg.tool_calls[0].function.arguments)}
    else:
        text = msg.content
        assert text.startswith(TOOL_CALL_START) and text.endswith(TOOL_CALL_END), text
        call = json.loads(text[len(TOOL_CALL_START): -len(TOOL_CALL_END)])
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], params)
    jsonschema.validate(call, forced_call_schema(tools, "required"))


@pytest.mark.parametrize("fmt,needle", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}, "JSON Schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "xml"}, "type"),
    ("json", "object"),
])
def test_bad_response_formats_get_a_400_naming_response_format(server, fmt, needle):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": fmt}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and needle in err["message"]


def test_a_tool_choice_naming_an_unknown_tool_gets_a_400(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("route", ["chat", "messages"])
def test_a_tool_whose_parameters_are_not_a_json_schema_gets_a_400_naming_tools(server, route):
    broken = {"type": "object", "properties": {"city": {"type": "nonsense"}}}
    if route == "chat":
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": broken}}]}
        r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools[0].function.parameters" and "JSON Schema" in err["message"]
    else:
        body = {"model": "tiny-qwen3-mtp", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                "tools": [{"name": "f", "input_schema": broken}]}
        r = httpx.post(server + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and "JSON Schema" in r.json()["error"]["message"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_tool_choice_any_or_tool_forces_a_valid_tool_use(server, choice):
    # Without the call grammar the shipped code model writes code here, not a call.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    # Both schemas bounded, so a sampled call always closes within max_tokens.
    other = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
             "additionalProperties": False}
    tools = [{"name": "get_weather", "input_schema": schema}, {"name": "other", "input_schema": other}]
    rng = _seed.rng()
    body = {"model": "tiny-qwen3-mtp", "max_tokens": 120, "tools": tools, "tool_choice": choice,
            "temperature": float(rng.choice([0.0, 0.9])),
            "messages": [{"role": "user", "content": str(rng.choice(PROMPTS))}]}
    r = httpx.post(server + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    msg = r.json()
    uses = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert msg["stop_reason"] == "tool_use" and len(uses) == 1, msg
    if choice["type"] == "tool":
        assert uses[0]["name"] == "get_weather"
    want = next(t["input_schema"] for t in tools if t["name"] == uses[0]["name"])
    jsonschema.validate(uses[0]["input"], want)
