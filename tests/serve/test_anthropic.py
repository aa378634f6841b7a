"""The Anthropic Messages API with the official anthropic client: the shipped model on a live server
(text, streams, stops, usage, errors, x-api-key) and a scripted engine for tool_use / tool_result loops."""

from __future__ import annotations

import json
import string

import httpx
import numpy as np
import pytest
import _seed

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from _serve import KEY, AppThread, ScriptedEngine, tool_model_folder  # noqa: E402

import mtplx_ext  # noqa: E402
from mtplx_ext.serve import load_chat_tokenizer  # noqa: E402
from mtplx_ext.shipped import SHIPPED_MODEL  # noqa: E402

MODEL = "tiny-qwen3-mtp"
#: Greedy decoding (this anthropic client has no sampling arguments of its own; the API has them).
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(live_server):
    base, key = live_server
    assert key == KEY
    return base


def _events(base: str, body: dict, headers: dict) -> list[tuple[str, dict]]:
    out = []
    with httpx.stream("POST", base + "/v1/messages", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == kind
                out.append((kind, data))
    return out


def test_messages_equal_the_chat_route_streamed_and_not(server):
    client = anthropic.Anthropic(base_url=server, api_key=KEY, timeout=120, max_retries=0)
    rng = _seed.rng()
    n = int(rng.integers(4, 16))
    user = "def " + "".join(rng.choice(list(string.ascii_lowercase), 6)) + "(a, b):"
    system = "# helpers"
    msg = client.messages.create(model=MODEL, max_tokens=n, extra_body=GREEDY, system=[{"type": "text", "text": system}],
                                 messages=[{"role": "user", "content": user}])
    chat = openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=n, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    text = chat.choices[0].message.content
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == (["text"] if text else [])
    assert "".join(b.text for b in msg.content) == text
    assert msg.usage.input_tokens == chat.usage.prompt_tokens and msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    with client.messages.stream(model=MODEL, max_tokens=n, extra_body=GREEDY, system=system,
                                messages=[{"role": "user", "content": user}]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    ev = _events(server, {"model": MODEL, "max_tokens": n, "temperature": 0, "stream": True,
                          "messages": [{"role": "user", "content": user}]}, {"x-api-key": KEY})
    kinds = [k for k, _ in ev]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    body = kinds[2:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    count = client.messages.count_tokens(model=MODEL, system=system, messages=[{"role": "user", "content": user}])
    assert count.input_tokens == msg.usage.input_tokens


def test_stop_sequences_end_the_text_and_are_reported(server):
    client = anthropic.Anthropic(base_url=server, api_key=KEY, timeout=120, max_retries=0)
    user = "class Stack:\n    def __init__(self):"
    free = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=[{"role": "user", "content": user}])
    full = free.content[0].text
    assert len(full) > 6
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, stop_sequences=[stop, "\x00never"],
                                 messages=[{"role": "user", "content": user}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == full[:full.index(stop)]


def test_errors_are_anthropic_shaped(server):
    client = anthropic.Anthropic(base_url=server, api_key=KEY, timeout=60, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                    cast_to=httpx.Response)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    bad = [{"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
           {"messages": [{"role": "system", "content": "x"}]},
           {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 10}},
           {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
           {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool", "name": "f"}},
           {"messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"}]
    for b in bad:
        r = httpx.post(server + "/v1/messages", json={"model": MODEL, "max_tokens": 4, **b}, headers={"x-api-key": KEY},
                       timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error", (b, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server + "/v1/messages/nope", json={}, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.fixture(scope="module")
def tool_app(tmp_path_factory):
    folder = tool_model_folder(tmp_path_factory.mktemp("tool-model"))
    eng = ScriptedEngine(mtplx_ext.load(SHIPPED_MODEL).tokenizer)
    with AppThread.scripted(eng, folder, api_key=KEY) as a:
        yield a, eng, load_chat_tokenizer(folder)


def test_tool_use_and_tool_result_round_trip_streamed_and_not(tool_app):
    a, eng, chat_tok = tool_app
    client = anthropic.Anthropic(base_url=a.base, api_key=KEY, timeout=60, max_retries=0)
    rng = _seed.rng()
    city = "".join(rng.choice(list(string.ascii_letters), 7))
    eng.reply = f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
    user = [{"role": "user", "content": f"Weather in {city}?"}]
    msg = client.messages.create(model="stub", max_tokens=200, system="Be brief.", tools=[WEATHER], messages=user)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Checking.\n"
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": city} and use.id.startswith("toolu_")
    oa_tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                  "parameters": WEATHER["input_schema"]}}]
    want = chat_tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *user], tools=oa_tools,
                                        tokenize=False, add_generation_prompt=True)
    assert eng.tokenizer.decode(eng.prompts[-1]) == want

    with client.messages.stream(model="stub", max_tokens=200, system="Be brief.", tools=[WEATHER], messages=user) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Checking.\n" and final.content[1].input == {"city": city}

    temp = f"{int(rng.integers(-20, 40))} C"
    eng.reply = f"It is {temp}."
    turn = user + [{"role": "assistant", "content": [{"type": "text", "text": "Checking.\n"},
                                                      {"type": "tool_use", "id": use.id, "name": use.name,
                                                       "input": use.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": [{"type": "text", "text": temp}]}]}]
    msg2 = client.messages.create(model="stub", max_tokens=200, tools=[WEATHER], messages=turn)
    assert msg2.stop_reason == "end_turn" and msg2.content[0].text == f"It is {temp}."
    oracle = [*user, {"role": "assistant", "content": "Checking.\n", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
        {"role": "tool", "tool_call_id": use.id, "content": temp}]
    want = chat_tok.apply_chat_template(oracle, tools=oa_tools, tokenize=False, add_generation_prompt=True)
    assert eng.tokenizer.decode(eng.prompts[-1]) == want
    # tool_choice none: no tools in the prompt, the call text stays text.
    eng.reply = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    none = client.messages.create(model="stub", max_tokens=200, tools=[WEATHER], tool_choice={"type": "none"},
                                  messages=user)
    assert none.stop_reason == "end_turn" and none.content[0].text == eng.reply
