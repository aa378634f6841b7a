"""Tool calling: the request checks, the forced call's schema, the parser on any chunking, and the whole
loop through the HTTP app with the official openai client (a scripted engine steers the reply)."""

from __future__ import annotations

import json
import string

import jsonschema
import numpy as np
import pytest
import _seed

openai = pytest.importorskip("openai")

from _serve import AppThread, ScriptedEngine, tool_model_folder  # noqa: E402

import mtplx_ext  # noqa: E402
from mtplx_ext.serve import BadRequest, load_chat_tokenizer  # noqa: E402
from mtplx_ext.serve.tools import (  # noqa: E402
    ToolStream,
    check_tools,
    chat_messages,
    forced_call_schema,
    split_reply,
    tool_format,
)
from mtplx_ext.shipped import SHIPPED_MODEL  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def _random_args(rng: np.random.Generator, depth: int = 0) -> dict:
    out: dict = {}
    for _ in range(int(rng.integers(0, 4))):
        key = "".join(rng.choice(list(string.ascii_lowercase), int(rng.integers(1, 8))))
        r = rng.integers(0, 5 if depth < 2 else 4)
        out[key] = [int(rng.integers(-99, 99)), "x < y </tool", 2.5, None, True][int(r)] if r < 4 else _random_args(rng, depth + 1)
    return out


def _random_text(rng: np.random.Generator) -> str:
    # '<' and partial markers in plain text must come through as text.
    parts = ["def f(a, b):", " return a < b", "\n", "<tool", "ok", " <tool_c", "é", "  "]
    return "".join(rng.choice(parts, int(rng.integers(0, 5))))


def test_tool_stream_cuts_the_calls_out_of_any_chunking_and_keeps_all_other_text():
    rng = _seed.rng()
    fmt = tool_format(None)  # the Qwen-style <tool_call>{json}</tool_call> format
    for _ in range(60):
        texts, calls, reply = [], [], ""
        for _ in range(int(rng.integers(0, 4))):
            t = _random_text(rng)
            call = {"name": str(rng.choice(["get_weather", "now", "x-y_z"])), "arguments": _random_args(rng)}
            texts.append(t)
            calls.append(call)
            reply += t + fmt.start + "\n" + json.dumps(call, ensure_ascii=bool(rng.integers(0, 2))) + "\n" + fmt.end
        tail = _random_text(rng)
        texts.append(tail)
        reply += tail
        cuts = sorted(set(rng.integers(0, len(reply) + 1, size=int(rng.integers(0, 12))).tolist()) | {0, len(reply)})
        ts = ToolStream(fmt, None)
        pieces = [p for a, b in zip(cuts, cuts[1:]) for p in ts.push(reply[a:b])] + ts.finish()
        assert "".join(p for k, p in pieces if k == "text") == "".join(texts)
        got = [p for k, p in pieces if k == "call"]
        assert [c["function"]["name"] for c in got] == [c["name"] for c in calls]
        assert [json.loads(c["function"]["arguments"]) for c in got] == [c["arguments"] for c in calls]
        assert len({c["id"] for c in got}) == len(got) and all(c["type"] == "function" for c in got)


@pytest.mark.parametrize("reply", [
    "a <tool_call>{not json}</tool_call> b",  # does not parse
    'a <tool_call>{"arguments": {}}</tool_call> b',  # no name
    'a <tool_call>{"name": "now", "arguments": "not json"}</tool_call> b',  # arguments no JSON object
    'a <tool_call>{"name": "now", "arguments": [1, 2]}</tool_call> b',
    'cut off <tool_call>{"name": "now", "argu',  # the reply ended inside the call
    "<tool_ca",  # the reply ended inside the marker
])
def test_a_call_that_does_not_parse_or_is_cut_off_comes_out_as_text(reply):
    text, calls = split_reply(tool_format(None), None, reply)
    assert text == reply and calls == []


@pytest.mark.parametrize("body,param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
])
def test_malformed_tools_and_tool_choice_are_refused_naming_the_field(body, param):
    with pytest.raises(BadRequest) as e:
        check_tools(body)
    assert e.value.param == param


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "assistant", "content": None}], "content must be a string"),
    ([{"role": "assistant", "content": None, "tool_calls": []}], "non-empty list"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}], "not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "JSON object"),
    ([{"role": "tool", "content": "42"}], "tool_call_id"),
    ([{"role": "robot", "content": "hi"}], "role must be one of"),
])
def test_malformed_tool_loop_messages_are_refused(messages, needle):
    with pytest.raises(BadRequest, match=needle) as e:
        chat_messages({"messages": messages})
    assert e.value.param == "messages"


def test_forced_call_schema_accepts_exactly_calls_of_the_chosen_tools():
    rng = _seed.rng()
    city = "".join(rng.choice(list(string.ascii_letters), 6))
    good_weather = {"name": "get_weather", "arguments": {"city": city, "days": int(rng.integers(1, 9))}}
    good_now = {"name": "now", "arguments": {}}
    bad = [{"name": "get_weather", "arguments": {"days": 3}},  # a required argument missing
           {"name": "get_weather", "arguments": {"city": 5}},  # a wrong type
           {"name": "unknown", "arguments": {}},
           {"arguments": {"city": city}},
           {"name": "now", "arguments": {}, "extra": 1}]
    required = forced_call_schema([WEATHER, CLOCK], "required")
    named = forced_call_schema([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}})
    for call in (good_weather, good_now):
        jsonschema.validate(call, required)
    jsonschema.validate(good_now, named)
    for call in bad + [good_weather]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, named)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, required)
    assert forced_call_schema([WEATHER], "auto") is None and forced_call_schema([WEATHER], "none") is None
    fmt = tool_format(None)  # the wrapper a grammar puts around the call
    text, calls = split_reply(fmt, None, fmt.prefix + json.dumps(good_weather) + fmt.suffix)
    assert text == "" and json.loads(calls[0]["function"]["arguments"]) == good_weather["arguments"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    folder = tool_model_folder(tmp_path_factory.mktemp("tool-model"))
    rt_tok = mtplx_ext.load(SHIPPED_MODEL).tokenizer
    eng = ScriptedEngine(rt_tok)
    with AppThread.scripted(eng, folder) as a:
        yield a, eng, load_chat_tokenizer(folder)


def _client(base: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)


def test_the_family_format_is_mlx_lms_parser_chosen_from_the_template(app):
    _, _, chat_tok = app
    fmt = tool_format(chat_tok)
    assert chat_tok.has_tool_calling and fmt.parse is chat_tok.tool_parser
    assert (fmt.start, fmt.end) == ("<tool_call>", "</tool_call>")


def test_a_tool_loop_round_trip_streamed_and_not_with_the_openai_client(app):
    a, eng, chat_tok = app
    rng = _seed.rng()
    client = _client(a.base)
    city = "".join(rng.choice(list(string.ascii_letters), 8))
    days = int(rng.integers(1, 9))
    eng.reply = (f"Let me look.\n<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': city, 'days': days}})}"
                 "\n</tool_call>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Weather in {city}?"}]
    r = client.chat.completions.create(model="stub", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me look.\n", ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city, "days": days}
    # The template got the tools (mlx-lm's wrapper renders them itself as the oracle).
    want = chat_tok.apply_chat_template(msgs, tools=[WEATHER, CLOCK], tokenize=False, add_generation_prompt=True)
    assert eng.tokenizer.decode(eng.prompts[-1]) == want and '"get_weather"' in want

    # Streamed: deltas with index, id, name, then arguments, as OpenAI's.
    chunks = list(client.chat.completions.create(model="stub", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=200,
                                                  stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me look.\n" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert {d.index for d in deltas} == {0} and deltas[0].id and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": city, "days": days}

    # The loop's next turn: the assistant's call with null content, then the tool's result.
    result = f"{int(rng.integers(-20, 40))} C"
    eng.reply = f"It is {result}."
    turn = msgs + [{"role": "assistant", "content": None, "tool_calls": [
                       {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": call.function.arguments}}]},
                   {"role": "tool", "tool_call_id": call.id, "content": result}]
    r2 = client.chat.completions.create(model="stub", messages=turn, tools=[WEATHER, CLOCK], max_tokens=200)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == f"It is {result}."
    assert r2.choices[0].message.tool_calls is None
    oracle = [dict(m) for m in turn]
    oracle[2] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city, "days": days}}}]}
    want = chat_tok.apply_chat_template(oracle, tools=[WEATHER, CLOCK], tokenize=False, add_generation_prompt=True)
    got = eng.tokenizer.decode(eng.prompts[-1])
    assert got == want and f"<tool_response>\n{result}\n</tool_response>" in got and f'"city": "{city}"' in got


def test_parallel_calls_none_choice_and_a_named_choice(app):
    a, eng, _ = app
    client = _client(a.base)
    calls = [{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    eng.reply = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)
    msgs = [{"role": "user", "content": "time and weather"}]
    r = client.chat.completions.create(model="stub", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=300)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["now", "get_weather"]
    assert r.choices[0].message.content is None
    chunks = list(client.chat.completions.create(model="stub", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=300,
                                                 stream=True))
    heads = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or []) if d.id]
    assert [(d.index, d.function.name) for d in heads] == [(0, "now"), (1, "get_weather")]
    one = client.chat.completions.create(model="stub", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=300,
                                         parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["now"]
    # "none": the template gets no tools and nothing is parsed.
    none = client.chat.completions.create(model="stub", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=300,
                                          tool_choice="none")
    assert none.choices[0].message.content == eng.reply and none.choices[0].finish_reason == "stop"
    assert "# Tools" not in eng.tokenizer.decode(eng.prompts[-1])
    # A named choice runs (unconstrained until a grammar forces it) and the call is parsed.
    named = client.chat.completions.create(model="stub", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=300,
                                           tool_choice={"type": "function", "function": {"name": "now"}})
    assert named.choices[0].finish_reason == "tool_calls"


def test_a_request_hands_the_grammar_its_forced_call(app):
    from types import SimpleNamespace

    from mtplx_ext.serve.openai import parse_request

    a, eng, chat_tok = app
    api = SimpleNamespace(tokenizer=eng.tokenizer, chat_tokenizer=chat_tok, eos_ids=(), engine=eng)
    msgs = [{"role": "user", "content": "now?"}]
    for choice, want in (("required", forced_call_schema([WEATHER, CLOCK], "required")),
                         ({"type": "function", "function": {"name": "now"}}, forced_call_schema([CLOCK], "required")),
                         ("auto", None)):
        _, _, reply = parse_request(api, {"messages": msgs, "tools": [WEATHER, CLOCK], "tool_choice": choice}, "chat")
        assert forced_call_schema(reply.tool_list, reply.tool_choice) == want
        assert (reply.fmt.prefix, reply.fmt.suffix) == ("<tool_call>\n", "\n</tool_call>")
