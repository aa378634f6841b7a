"""Forced tool calls end when the call closes, and structured outputs fail cleanly (the shipped model on
`mtplx-ext serve` in this process: tests/_serve.py).

A forced call (OpenAI `tool_choice` required / named, Anthropic `any` / `tool`)
must end at its closing marker: the request's tokens are exactly the call's
text and the stop token, the OpenAI answer's finish_reason is "tool_calls"
and Claude Code's request shape (POST /v1/messages?beta=true, streamed, a
named tool) gets a streamed tool_use block (content_block_start of type
tool_use, input_json_delta deltas, content_block_stop) and stop_reason
"tool_use", read with the official anthropic and openai clients. The same
check rejects a call grammar that lets the answer run on after the closing
marker. Without the grammar engine, or with a schema it cannot build, a
structured request gets a 400 naming the field (never a 500), and the
server's startup line says whether structured outputs are on.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import httpx
import pytest
import _seed

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from _serve import AppThread, LiveServer  # noqa: E402

from mtplx_ext.decode.constraint import GrammarVocab  # noqa: E402
from mtplx_ext.serve import API  # noqa: E402
from mtplx_ext.serve import structured  # noqa: E402
from mtplx_ext.serve.server import started  # noqa: E402
from mtplx_ext.serve.tools import tool_format  # noqa: E402
from mtplx_ext.shipped import eos_ids  # noqa: E402

FMT = tool_format(None)  # the shipped tokenizer names no tool format: the Qwen-style JSON one
#: Bounded arguments, so that every sampled call closes well within max_tokens.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
         "additionalProperties": False}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                {"type": "function", "function": {"name": "now", "parameters": CLOCK}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
                   {"name": "now", "description": "The time.", "input_schema": CLOCK}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def live():
    with LiveServer("--max-batch", "4", "--depth", "2") as s:
        yield s


@pytest.fixture(scope="module")
def server(live):
    return live.base


@pytest.fixture
def requests(live, monkeypatch):
    """The engine requests the live server submits during one test (their tokens, finish reasons)."""
    got = []
    real = live.api.submit
    monkeypatch.setattr(live.api, "submit", lambda *a: got.append(real(*a)) or got[-1])
    return got


def ended_at_the_close(live, r) -> dict:
    """The call of a finished request whose answer is exactly one call then the stop token; else AssertionError."""
    eos = set(eos_ids(live.api.tokenizer))
    assert r.finish_reason == "stop" and len(r.tokens) < MAX_TOKENS, f"ran on: {r.finish_reason}, {len(r.tokens)} tokens"
    assert r.tokens[-1] in eos, "did not end with the stop token"
    text = live.api.tokenizer.decode(r.tokens[:-1])
    assert text.startswith(FMT.prefix) and text.endswith(FMT.suffix), f"not one call: {text!r}"
    return json.loads(text[len(FMT.prefix): -len(FMT.suffix)])


def broken_call_grammar(self, prefix, schema, suffix, strict=True, lenient=False):
    """The call grammar without its end: any text may follow the closing marker."""
    import llguidance

    body = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    lark = (f"start: {json.dumps(prefix)} call {json.dumps(suffix)} TAIL\nTAIL: /(.|\\n)*/\n"
            f"call: %json {json.dumps(body)}")
    return self.grammar(llguidance.LLMatcher.grammar_from_lark(lark))


def openai_forced_stream(base: str, choice, seed: int) -> tuple[str, list[dict]]:
    """(finish_reason, tool calls) of a streamed forced call read with the openai client."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny-qwen3-mtp", messages=[{"role": "user", "content": "weather = "}], max_tokens=MAX_TOKENS,
        temperature=0.8, seed=seed, tools=OPENAI_TOOLS, tool_choice=choice, stream=True))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            call["name"] = call["name"] or (d.function.name if d.function else None)
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == "", f"text besides the call: {text!r}"
    return finish[-1], [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls.values()]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_openai_call_ends_when_it_closes(live, requests, choice):
    rng = _seed.rng()
    finish, calls = openai_forced_stream(live.base, choice, int(rng.integers(1 << 31)))
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    (call,) = calls
    assert ended_at_the_close(live, requests[-1]) == call
    if isinstance(choice, dict):
        assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER if call["name"] == "get_weather" else CLOCK)


def test_claude_codes_forced_call_streams_as_a_tool_use_block(live, requests):
    rng = _seed.rng()
    client = anthropic.Anthropic(base_url=live.base, api_key="none", timeout=120, max_retries=0)
    # Claude Code's shape: ?beta=true, system blocks, metadata, a named tool, streamed.
    with client.messages.stream(
            model="tiny-qwen3-mtp", max_tokens=MAX_TOKENS, extra_query={"beta": "true"},
            system=[{"type": "text", "text": "You are a coding assistant."}], metadata={"user_id": "u-1"},
            messages=[{"role": "user", "content": [{"type": "text", "text": str(rng.choice(["weather = ", "def f():"]))}]}],
            tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": float(rng.choice([0.0, 1.0]))}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["tool_use"], [e.content_block for e in starts]
    assert starts[0].content_block.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert [e.type for e in events if e.type == "content_block_stop"] == ["content_block_stop"]
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    jsonschema.validate(final.content[0].input, WEATHER)
    call = ended_at_the_close(live, requests[-1])
    assert call == {"name": "get_weather", "arguments": final.content[0].input}


def test_the_check_rejects_a_call_grammar_that_does_not_end_at_the_close(live, requests, monkeypatch):
    monkeypatch.setattr(GrammarVocab, "wrapped_json", broken_call_grammar)
    body = {"messages": [{"role": "user", "content": "weather = "}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = httpx.post(live.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    with pytest.raises(AssertionError, match="ran on|not one call"):
        ended_at_the_close(live, requests[-1])


@pytest.mark.parametrize("merged", [True, False])
def test_a_forced_call_ends_even_where_the_server_knows_no_stop_token(live, requests, monkeypatch, merged):
    # A tokenizer whose end-of-text token has a name the server does not know: the grammar's own stop token
    # (the tokenizer's EOS) must end the request. Unmerged, the check must see the answer run on.
    if not merged:
        monkeypatch.setattr(structured, "submit_args", lambda args, c, grammar=None: {**args, "constraint": c})
    nameless = API(live.api.engine, "nameless", live.api.tokenizer, live.api.chat_tokenizer, eos_ids=())
    with AppThread(nameless) as app:
        monkeypatch.setattr(nameless, "submit", live.api.submit)  # the recording one
        body = {"messages": [{"role": "user", "content": "weather = "}], "max_tokens": MAX_TOKENS, "temperature": 0,
                "tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        r = httpx.post(app.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if merged:
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls", r.json()
        ended_at_the_close(live, requests[-1])
    else:
        with pytest.raises(AssertionError, match="ran on|not one call"):
            ended_at_the_close(live, requests[-1])


@pytest.mark.parametrize("route,field", [("response_format", "response_format"), ("openai_tool", "tool_choice"),
                                         ("anthropic_tool", "tool_choice")])
def test_without_the_grammar_engine_a_structured_request_gets_a_400_naming_the_extra(live, monkeypatch, route, field):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` now fails as if not installed
    msgs = [{"role": "user", "content": "x = "}]
    if route == "anthropic_tool":
        body = {"max_tokens": 8, "messages": msgs, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}}
        r = httpx.post(live.base + "/v1/messages?beta=true", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"
    else:
        extra = ({"response_format": {"type": "json_object"}} if route == "response_format"
                 else {"tools": OPENAI_TOOLS, "tool_choice": "required"})
        r = httpx.post(live.base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field
    assert "pip install 'mtplx-ext[serve]'" in err["message"] and field in err["message"]
    # Plain requests still answer.
    r = httpx.post(live.base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


def test_the_startup_line_says_whether_structured_outputs_are_on(live, monkeypatch):
    assert any("structured outputs on (llguidance" in line for line in live.log), live.log
    monkeypatch.setitem(sys.modules, "llguidance", None)
    lines: list[str] = []
    idle = SimpleNamespace(engine=SimpleNamespace(start=lambda: None, stop=lambda: None))
    with started(idle, warm=False, log=lines.append):
        pass
    assert [line for line in lines if "structured outputs" in line] == [f"mtplx-ext serve: {structured.capability()}"]
    assert "structured outputs off" in lines[0] and "pip install 'mtplx-ext[serve]'" in lines[0]


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_valid_schema_the_grammar_engine_cannot_build_gets_a_400(server, where):
    lookahead = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=x)"}}, "required": ["a"]}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    if where == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": lookahead}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": lookahead}}]
        body["tool_choice"] = "required"
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == where and "look-around" in err["message"]


#: Valid JSON Schema with a keyword the grammar engine does not implement.
UNIQUE = {"type": "object", "properties": {"t": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2,
                                                 "uniqueItems": True}}, "required": ["t"], "additionalProperties": False}


@pytest.mark.parametrize("strict", [True, False])
def test_an_unimplemented_keyword_is_refused_when_strict_and_ignored_otherwise(server, strict):
    body = {"messages": [{"role": "user", "content": "x = "}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": UNIQUE, "strict": strict}}}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    if strict:  # OpenAI's strict mode refuses what it cannot enforce
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format" and "uniqueItems" in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), {**UNIQUE, "properties": {"t": {
        "type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}}})


def test_a_forced_call_of_a_tool_with_an_unimplemented_keyword_is_made(server):
    body = {"messages": [{"role": "user", "content": "x = "}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "pick", "parameters": UNIQUE}}], "tool_choice": "required"}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "pick"
