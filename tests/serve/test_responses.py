"""The OpenAI Responses API (`/v1/responses`) with the official openai client.

Against the shared live server (the shipped model, tests/serve/conftest.py):
greedy answers equal the chat route's for the same conversation (the chat
route is the peer oracle: same template, engine and sampling), streams
rebuild the same response through the client's own stream helper, and
`text.format` json_schema answers validate. Against the app over a scripted
engine (tests/_serve.py), which steers the reply: prompts equal mlx-lm's
chat template applied to the equivalent chat messages, function-call loops
(stateless and through `previous_response_id`), a request shaped as Codex
CLI sends it, and the 400s of fields this server does not implement.
"""

from __future__ import annotations

import json
import string
import time

import httpx
import numpy as np
import pytest
import _seed

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from _live_server import metrics  # noqa: E402
from _serve import AppThread, ScriptedEngine, tool_model_folder  # noqa: E402


import mtplx_ext  # noqa: E402
from mtplx_ext.serve import load_chat_tokenizer  # noqa: E402
from mtplx_ext.serve.responses_output import Output  # noqa: E402
from mtplx_ext.shipped import SHIPPED_MODEL  # noqa: E402

MODEL = "tiny-qwen3-mtp"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city", "days"], "additionalProperties": False}}
CLOCK = {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}}


def _nested(tool: dict) -> dict:
    """A flat Responses tool in the chat route's nested shape (what chat templates are given)."""
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if k in tool}}


def _client(base: str, key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=120, max_retries=0)


def _word(rng: np.random.Generator, n: int = 8) -> str:
    return "".join(rng.choice(list(string.ascii_letters), n))


# -- the event grammar ------------------------------------------------------------------


def check_events(events: list[dict]) -> dict:
    """Asserts a Responses stream's order (OpenAI's) and returns its final response.

    created, in_progress; per item: output_item.added, then (messages)
    content_part.added, output_text.delta..., output_text.done,
    content_part.done, (reasoning, the first item only) content_part.added,
    reasoning_text.delta..., reasoning_text.done, content_part.done, or
    (calls) function_call_arguments.delta..., .done; output_item.done; then
    completed / incomplete. Sequence numbers count from 0; deltas
    concatenate to each item's final text.
    """
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    final = events[-1]["response"]
    rid = final["id"]
    assert all(e["response"]["id"] == rid for e in events if "response" in e)
    i, index = 2, 0
    while i < len(events) - 1:
        e = events[i]
        assert e["type"] == "response.output_item.added" and e["output_index"] == index, (i, kinds)
        item, i = e["item"], i + 1
        if item["type"] == "message":
            assert events[i]["type"] == "response.content_part.added"
            i, text = i + 1, ""
            while events[i]["type"] == "response.output_text.delta":
                assert events[i]["item_id"] == item["id"] and events[i]["output_index"] == index
                text, i = text + events[i]["delta"], i + 1
            assert events[i]["type"] == "response.output_text.done" and events[i]["text"] == text
            assert events[i + 1]["type"] == "response.content_part.done" and events[i + 1]["part"]["text"] == text
            i += 2
            done_text = text
        elif item["type"] == "reasoning":
            assert index == 0 and item["summary"] == [] and item["content"] == [], (index, item)
            assert events[i]["type"] == "response.content_part.added"
            assert events[i]["part"] == {"type": "reasoning_text", "text": ""}
            i, text = i + 1, ""
            while events[i]["type"] == "response.reasoning_text.delta":
                assert events[i]["item_id"] == item["id"] and events[i]["output_index"] == index
                text, i = text + events[i]["delta"], i + 1
            assert events[i]["type"] == "response.reasoning_text.done" and events[i]["text"] == text
            assert events[i + 1]["type"] == "response.content_part.done"
            assert events[i + 1]["part"] == {"type": "reasoning_text", "text": text}
            i += 2
            done_text = text
        else:
            assert item["type"] == "function_call"
            args = ""
            while events[i]["type"] == "response.function_call_arguments.delta":
                args, i = args + events[i]["delta"], i + 1
            assert events[i]["type"] == "response.function_call_arguments.done" and events[i]["arguments"] == args
            i += 1
            done_text = args
        done = events[i]
        assert done["type"] == "response.output_item.done" and done["output_index"] == index
        assert done["item"]["id"] == item["id"] and final["output"][index] == done["item"]
        got = done["item"]["arguments"] if item["type"] == "function_call" else done["item"]["content"][0]["text"]
        assert got == done_text
        i, index = i + 1, index + 1
    assert index == len(final["output"]) > 0
    return final


def _raw_stream(base: str, body: dict, key: str = "none") -> list[dict]:
    """The SSE events of a streamed request, as JSON (each `event:` line names its data's type)."""
    events = []
    with httpx.stream("POST", base + "/v1/responses", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == name
                events.append(ev)
    return events


def test_the_event_check_rejects_broken_streams():
    out = Output(calls_parsed=True)
    evs = [out.event("response.created", response={"id": "r"}), out.event("response.in_progress", response={"id": "r"})]
    evs += out.push([("text", "Hi "), ("text", "there"), ("call", {"id": "call_1", "function": {
        "name": "f", "arguments": "{}"}}), ("text", " \n")])
    evs += out.close()
    evs.append(out.event("response.completed", response={"id": "r", "output": out.items}))
    assert check_events(evs)["output"] == out.items
    assert [it["type"] for it in out.items] == ["message", "function_call"]  # the trailing whitespace opens nothing
    broken = [
        evs[:3] + evs[4:],  # a missing event (and a gap in the sequence numbers)
        [*evs[:4], {**evs[5], "sequence_number": 4}, {**evs[4], "sequence_number": 5}, *evs[6:]],  # two swapped
        evs[:-1],  # no completed
    ]
    for b in broken:
        with pytest.raises((AssertionError, IndexError, KeyError)):
            check_events(b)


# -- the live server: the shipped model -----------------------------------------------


def test_greedy_answers_equal_the_chat_routes_streamed_or_not(live_server):
    base, key = live_server
    rng = _seed.rng()
    c = _client(base, key)
    prompt = str(rng.choice(["def parse(data):\n    return", "class Stack:\n    def push(self, x):", "import os\n"]))
    n = int(rng.integers(8, 24))
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Code."},
                                                            {"role": "user", "content": prompt}],
                                     max_tokens=n, temperature=0)
    r = c.responses.create(model=MODEL, instructions="Code.", input=prompt, max_output_tokens=n, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    want_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == want_status and r.output[0].status == want_status
    if want_status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"

    # Items instead of a string: the same conversation, the same answer.
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Code."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}]
    r2 = c.responses.create(model=MODEL, input=items, max_output_tokens=n, temperature=0)
    assert r2.output_text == r.output_text and r2.id != r.id

    # Streamed: the client's helper rebuilds the same response; the raw events follow OpenAI's order.
    with c.responses.stream(model=MODEL, instructions="Code.", input=prompt, max_output_tokens=n,
                            temperature=0) as s:
        deltas = "".join(ev.delta for ev in s if ev.type == "response.output_text.delta")
        final = s.get_final_response() if want_status == "completed" else None
    assert deltas == r.output_text
    if final is not None:
        assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens
    raw = check_events(_raw_stream(base, {"model": MODEL, "instructions": "Code.", "input": prompt,
                                          "max_output_tokens": n, "temperature": 0}, key))
    assert raw["status"] == want_status and raw["output"][0]["content"][0]["text"] == r.output_text


def test_a_reply_cut_by_max_output_tokens_is_incomplete(live_server):
    base, key = live_server
    c = _client(base, key)
    r = c.responses.create(model=MODEL, input="def main():\n", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    events = _raw_stream(base, {"model": MODEL, "input": "def main():\n", "max_output_tokens": 3, "temperature": 0},
                         key)
    assert check_events(events)["status"] == "incomplete" and events[-1]["type"] == "response.incomplete"


def test_logprobs_equal_the_chat_routes_and_stream_with_the_deltas(live_server):
    base, key = live_server
    rng = _seed.rng()
    c = _client(base, key)
    top = int(rng.integers(0, 6))
    prompt = "def add(a, b):\n"
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
                                     temperature=0, logprobs=True, top_logprobs=top)
    want = [t.model_dump() for t in chat.choices[0].logprobs.content]
    r = c.responses.create(model=MODEL, input=prompt, max_output_tokens=12, temperature=0,
                           include=["message.output_text.logprobs"], top_logprobs=top)
    part = r.output[0].content[0]
    assert part.text == chat.choices[0].message.content
    got = [lp.model_dump() for lp in part.logprobs]
    assert [(g["token"], g["bytes"]) for g in got] == [(w["token"], w["bytes"]) for w in want]
    assert np.allclose([g["logprob"] for g in got], [w["logprob"] for w in want], atol=1e-5)
    assert [len(g["top_logprobs"]) for g in got] == [top] * len(want)
    events = _raw_stream(base, {"model": MODEL, "input": prompt, "max_output_tokens": 12, "temperature": 0,
                                "include": ["message.output_text.logprobs"], "top_logprobs": top}, key)
    final = check_events(events)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [x["token"] for x in streamed] == [g["token"] for g in got]
    assert final["output"][0]["content"][0]["logprobs"] == streamed
    plain = c.responses.create(model=MODEL, input=prompt, max_output_tokens=4, temperature=0)
    assert plain.output[0].content[0].logprobs == []


def _settled(base: str, key: str, cancelled: int, timeout: float = 5) -> dict:
    """The metrics once `cancelled` requests were cancelled and no row is left decoding."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base, key)
        if m["cancelled"] >= cancelled and m["live_streams"] == 0 and m["kv_slots"] == 0:
            return m
        assert time.time() < deadline, f"not cancelled within {timeout} s: {m}"
        time.sleep(0.005)


def test_clients_that_go_away_cancel_their_requests(live_server):
    base, key = live_server
    before = metrics(base, key)
    body = {"model": MODEL, "input": "def main():", "max_output_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # the stream is flowing: close it mid-reply
    m = _settled(base, key, before["cancelled"] + 1)
    assert m["generated_tokens"] - before["generated_tokens"] < 1500 and m["finished"] == before["finished"]
    # Unstreamed: the official client gives up after its timeout; the request does not decode on.
    with pytest.raises(openai.APITimeoutError):
        openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=0.5, max_retries=0).responses.create(
            model=MODEL, input="import os\n", max_output_tokens=1500, temperature=0)
    m = _settled(base, key, before["cancelled"] + 2)
    assert m["finished"] == before["finished"]


class Answer(pydantic.BaseModel):
    ok: bool
    count: int = pydantic.Field(ge=0, le=99)
    color: str = pydantic.Field(json_schema_extra={"enum": ["red", "green"]})


def test_json_schema_answers_parse_and_validate(live_server):
    pytest.importorskip("llguidance")
    base, key = live_server
    rng = _seed.rng()
    c = _client(base, key)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "n"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    r = c.responses.create(model=MODEL, input="config = ", text=fmt, max_output_tokens=120,
                           temperature=float(rng.choice([0.0, 0.8])), extra_body={"seed": int(rng.integers(1 << 30))})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    # The client's own structured-output helper: a pydantic model's strict schema, parsed back.
    parsed = c.responses.parse(model=MODEL, input="settings = ", text_format=Answer, max_output_tokens=120,
                               temperature=0)
    assert isinstance(parsed.output_parsed, Answer) and parsed.output_parsed.color in ("red", "green")
    obj = c.responses.create(model=MODEL, input="data = ", text={"format": {"type": "json_object"}},
                             max_output_tokens=200, temperature=0)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    else:
        assert obj.output_text.startswith("{")
    bad = httpx.post(base + "/v1/responses", headers={"Authorization": f"Bearer {key}"}, timeout=60, json={
        "input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format", bad.text


# -- the scripted engine: prompts, tool loops, Codex, refusals -------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The shipped tokenizer with a Qwen-style tool template (tests/_serve.py)."""
    return tool_model_folder(tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="module")
def app(folder):
    eng = ScriptedEngine(mtplx_ext.load(SHIPPED_MODEL).tokenizer)
    with AppThread.scripted(eng, folder) as a:
        yield a, eng, load_chat_tokenizer(folder)


def _template(chat_tok, messages: list[dict], tools: list[dict] | None = None) -> str:
    kw = {"tools": [_nested(t) for t in tools]} if tools else {}
    return chat_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


def test_input_items_reach_the_template_as_the_equivalent_chat_messages(app):
    a, eng, chat_tok = app
    rng = _seed.rng()
    c = _client(a.base)
    words = [_word(rng) for _ in range(5)]
    eng.reply = "fine"
    items = [{"role": "developer", "content": words[0]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words[1]},
                                                             {"type": "input_text", "text": words[2]}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},  # no reasoning text: nothing to render
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": words[3]}]},
             {"role": "user", "content": words[4]}]
    r = c.responses.create(model="stub", instructions="Be brief.", input=items)
    assert r.output_text == "fine" and r.status == "completed" and r.instructions == "Be brief."
    want = _template(chat_tok, [{"role": "system", "content": "Be brief.\n\n" + words[0]},
                                {"role": "user", "content": words[1] + words[2]},
                                {"role": "assistant", "content": words[3]}, {"role": "user", "content": words[4]}])
    assert eng.tokenizer.decode(eng.prompts[-1]) == want
    assert r.usage.input_tokens == len(eng.prompts[-1])
    n = len(eng.prompts)
    count = c.responses.input_tokens.count(model="stub", instructions="Be brief.", input=items)
    assert count.input_tokens == r.usage.input_tokens and len(eng.prompts) == n  # counted, not decoded


def _call_reply(rng: np.random.Generator) -> tuple[str, dict]:
    args = {"city": _word(rng), "days": int(rng.integers(1, 9))}
    return (f"Let me look.\n<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': args})}\n</tool_call>\n",
            args)


def test_a_function_call_loop_stateless_and_through_previous_response_id(app):
    a, eng, chat_tok = app
    rng = _seed.rng()
    c = _client(a.base)
    eng.reply, args = _call_reply(rng)
    first = [{"role": "user", "content": f"Weather in {args['city']}?"}]
    r = c.responses.create(model="stub", input=first, tools=[WEATHER, CLOCK])
    assert [it.type for it in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert r.output[0].content[0].text == "Let me look.\n"
    assert call.name == "get_weather" and json.loads(call.arguments) == args
    assert call.call_id and call.status == "completed"
    assert eng.tokenizer.decode(eng.prompts[-1]) == _template(chat_tok, first, [WEATHER, CLOCK])

    # Streamed: the same items through the client's stream helper, the call's arguments as a delta.
    with c.responses.stream(model="stub", input=first, tools=[WEATHER, CLOCK]) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [(it.type, getattr(it, "name", None)) for it in final.output] == [("message", None),
                                                                             ("function_call", "get_weather")]
    assert json.loads(final.output[1].arguments) == args
    kept = c.responses.retrieve(final.id)  # a streamed response is stored as it completes
    assert kept.status == "completed" and [it.id for it in kept.output] == [it.id for it in final.output]
    assert kept.output_text == final.output_text and kept.output[1].arguments == final.output[1].arguments

    # The next turn: the client runs the tool and sends its output, with the history or by reference.
    result = f"{int(rng.integers(-20, 40))} C"
    eng.reply = f"It is {result}."
    out = {"type": "function_call_output", "call_id": call.call_id, "output": result}
    oracle = first + [{"role": "assistant", "content": "Let me look.\n", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    want = _template(chat_tok, oracle, [WEATHER, CLOCK])
    stateless = c.responses.create(model="stub", tools=[WEATHER, CLOCK], store=False,
                                   input=first + [it.model_dump(exclude_none=True) for it in r.output] + [out])
    assert stateless.output_text == f"It is {result}." and [it.type for it in stateless.output] == ["message"]
    assert eng.tokenizer.decode(eng.prompts[-1]) == want and f"<tool_response>\n{result}\n</tool_response>" in want
    chained = c.responses.create(model="stub", tools=[WEATHER, CLOCK], previous_response_id=r.id, input=[out])
    assert chained.output_text == f"It is {result}." and chained.previous_response_id == r.id
    assert eng.tokenizer.decode(eng.prompts[-1]) == want
    # store: false kept nothing; a stored response can be read back and deleted.
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(stateless.id)
    assert c.responses.retrieve(chained.id).output_text == chained.output_text
    c.responses.delete(chained.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="stub", input="x", previous_response_id=chained.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_parallel_calls_and_tool_choice(app):
    a, eng, _ = app
    c = _client(a.base)
    calls = [{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]
    eng.reply = "".join(f"<tool_call>\n{json.dumps(x)}\n</tool_call>\n" for x in calls)
    r = c.responses.create(model="stub", input="time and weather", tools=[WEATHER, CLOCK])
    assert [(it.type, it.name) for it in r.output] == [("function_call", "now"), ("function_call", "get_weather")]
    one = c.responses.create(model="stub", input="time and weather", tools=[WEATHER, CLOCK], parallel_tool_calls=False)
    assert [it.name for it in one.output] == ["now"] and one.parallel_tool_calls is False
    none = c.responses.create(model="stub", input="time and weather", tools=[WEATHER, CLOCK], tool_choice="none")
    assert none.output_text == eng.reply and "# Tools" not in eng.tokenizer.decode(eng.prompts[-1])
    named = c.responses.create(model="stub", input="x", tools=[WEATHER, CLOCK],
                               tool_choice={"type": "function", "name": "now"})
    assert named.tool_choice.name == "now" and named.output[0].type == "function_call"


def test_a_codex_shaped_request_streams_a_call_and_takes_its_output(app):
    """The body Codex CLI sends (its `ResponsesApiRequest`): instructions, developer and user items with
    input_text parts, flat function tools, tool_choice auto, no parallel calls, reasoning null, store false,
    stream, include [], a prompt_cache_key; then the whole history again with the call's output."""
    a, eng, chat_tok = app
    rng = _seed.rng()
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
             "strict": False, "parameters": {"type": "object", "properties": {
                 "command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"},
                 "timeout_ms": {"type": "number"}}, "required": ["command"], "additionalProperties": False}}
    task = f"list the files in {_word(rng)}"
    history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": task}]},
    ]
    body = {"model": "stub", "instructions": "You are a coding agent.", "input": history, "tools": [shell],
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": None, "store": False, "stream": True,
            "include": [], "prompt_cache_key": "0b6f2c1e-4f7a-4d6e-9c1b-3a2d5e8f7a90",
            "client_metadata": {"x-codex-turn": "1"}}
    eng.reply = '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls", "-la"]}}\n</tool_call>'
    final = check_events(_raw_stream(a.base, body))
    (call,) = final["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"command": ["ls", "-la"]}
    assert final["store"] is False and final["usage"]["input_tokens"] == len(eng.prompts[-1])
    msgs = [{"role": "system", "content": "You are a coding agent.\n\n<permissions>"},
            {"role": "user", "content": "<environment_context>"}, {"role": "user", "content": task}]
    assert eng.tokenizer.decode(eng.prompts[-1]) == _template(chat_tok, msgs, [shell])
    # Codex keeps the history itself (store: false) and sends the call back without its item id.
    eng.reply = "Done: two files."
    sent_call = {"type": "function_call", "name": "shell", "arguments": call["arguments"], "call_id": call["call_id"]}
    body["input"] = history + [sent_call, {"type": "function_call_output", "call_id": call["call_id"],
                                           "output": "a.py\nb.py"}]
    final = check_events(_raw_stream(a.base, body))
    assert final["output"][0]["content"][0]["text"] == "Done: two files." and final["status"] == "completed"
    turn = msgs + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "shell", "arguments": {"command": ["ls", "-la"]}}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "a.py\nb.py"}]
    got = eng.tokenizer.decode(eng.prompts[-1])
    assert got == _template(chat_tok, turn, [shell]) and "<tool_response>\na.py\nb.py\n</tool_response>" in got
    assert httpx.get(f"{a.base}/v1/responses/{final['id']}").status_code == 404  # not stored


class FailingEngine(ScriptedEngine):
    """Fails every request after its first tokens: an engine error in the middle of a reply."""

    def _run(self, r, detok, ids, cuts):
        new = ids[:2]
        r.commit(new, detok.push(new, final=False)[0])
        r.fail("the device went away")


def test_a_request_that_fails_ends_its_stream_with_error_and_response_failed(app, folder):
    _, eng, _ = app
    failing = FailingEngine(eng.tokenizer)
    failing.reply = "def f(x):\n    return x + 1\n"
    with AppThread.scripted(failing, folder) as b:
        events = _raw_stream(b.base, {"model": "stub", "input": "hi"})
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert "the device went away" in events[-2]["message"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        with pytest.raises(openai.InternalServerError):
            _client(b.base).responses.create(model="stub", input="hi")
        assert httpx.get(f"{b.base}/v1/responses/{events[-1]['response']['id']}").status_code == 404


@pytest.mark.parametrize("extra,param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [CLOCK, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[1].type"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 800, "display_height": 600,
                 "environment": "linux"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, "tools[0].parameters"),
    ({"tools": [CLOCK], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # this template's model has no reasoning markers
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({"reasoning": {"context": "all_turns"}}, "reasoning.context"),
    ({"reasoning": {"budget": 3}}, "reasoning.budget"),
    ({"reasoning": "high"}, "reasoning"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "text", "text": "x"}]}]},
     "input[0].content[0]"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{x"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": ""}, "input"),
    ({"input": 3}, "input"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"max_tokens": 4}, "max_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"store": "yes"}, "store"),
    ({"model": "gpt-5"}, "model"),
])
def test_unsupported_or_malformed_fields_get_a_400_naming_them(app, extra, param):
    a, eng, _ = app
    n = len(eng.prompts)
    r = httpx.post(a.base + "/v1/responses", json={"model": "stub", "input": "hi", **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert len(eng.prompts) == n  # nothing reached the engine


def test_fields_that_ask_for_nothing_are_accepted(app):
    a, eng, _ = app
    eng.reply = "ok"
    body = {"model": "stub", "input": "hi", "background": False, "reasoning": None, "include": [], "store": True,
            "truncation": "disabled", "service_tier": "auto", "metadata": {"k": "v"}, "user": "u",
            "safety_identifier": "s", "prompt_cache_key": "p", "text": {"format": {"type": "text"},
                                                                       "verbosity": "medium"}}
    r = httpx.post(a.base + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"} and r.json()["output"][0]["content"][0]["text"] == "ok"
