"""Reasoning models through the HTTP app, with the official openai and anthropic clients.

A scripted engine (tests/_serve.py) writes replies with `<think>` markers
(several tokens each in the shipped tokenizer, so its random chunks cut
them anywhere): OpenAI's `reasoning_content` and Anthropic's `thinking`
blocks hold exactly the reasoning an independent oracle finds, streamed
deltas concatenate to the non-streamed reply, and the request's reasoning
fields reach a test template that renders them. The shipped model, which
never closes a reasoning block itself, shows the budget forcing the end
marker and a JSON schema applying to the answer after the reasoning only.
"""

from __future__ import annotations

import json

import httpx
import pytest

import _seed

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from _reasoning import SCHEMA, folder, live, scripted  # noqa: E402,F401  (fixtures)
from _serve import AppThread  # noqa: E402
from _reasoning import reply_text as _reply  # noqa: E402
from test_reasoning_splitter import oracle  # noqa: E402

from mtplx_ext.serve import API, load_chat_tokenizer  # noqa: E402

OPEN = {"chat_template_kwargs": {"enable_thinking": True}}
USER = [{"role": "user", "content": "def parse(data):"}]


def _oa(base: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)


def _an(base: str) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=base, api_key="none", timeout=120, max_retries=0)


CASES = [  # (request fields, the prompt opened the reasoning, how the model writes its reply)
    (OPEN, True, "{r}\n</think>\n\n{a}"),
    ({"chat_template_kwargs": {"free": True}}, False, "<think>\n{r}</think>{a}"),
    ({}, False, "{r}<think>{a}"),  # the prompt closed the reasoning and the reply opens none: all text
]


@pytest.mark.parametrize("fields, opened, shape", CASES)
def test_openai_reasoning_content_streamed_and_not(scripted, fields, opened, shape):
    a, eng = scripted
    rng = _seed.rng()
    c = _oa(a.base)
    for _ in range(3):
        eng.reply = shape.format(r=_reply(rng), a=_reply(rng))
        want_r, want_a = oracle(eng.reply, opened)
        msg = c.chat.completions.create(model="stub", messages=USER, max_tokens=400, extra_body=fields
                                        ).choices[0].message
        assert (msg.reasoning_content, msg.content) == (want_r or None, want_a), eng.reply
        parts: dict[str, list[str]] = {"reasoning_content": [], "content": []}
        for chunk in c.chat.completions.create(model="stub", messages=USER, max_tokens=400, stream=True,
                                               extra_body=fields):
            for ch in chunk.choices:
                for k, v in parts.items():
                    if getattr(ch.delta, k, None):
                        v.append(getattr(ch.delta, k))
        assert "".join(parts["reasoning_content"]) == want_r and "".join(parts["content"]) == want_a


@pytest.mark.parametrize("fields, opened, shape", CASES[:2])
def test_anthropic_thinking_blocks_streamed_and_not(scripted, fields, opened, shape):
    a, eng = scripted
    rng = _seed.rng()
    c = _an(a.base)
    for _ in range(3):
        eng.reply = shape.format(r=_reply(rng) + "r", a=_reply(rng) + "a")
        want_r, want_a = oracle(eng.reply, opened)
        msg = c.messages.create(model="stub", max_tokens=400, messages=USER, extra_body=fields)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert (msg.content[0].thinking, msg.content[1].text) == (want_r, want_a)
        assert msg.content[0].signature  # opaque, non-empty: clients keep the block and send it back
        with c.messages.stream(model="stub", max_tokens=400, messages=USER, extra_body=fields) as s:
            events = list(s)
            final = s.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
            ("thinking", want_r), ("text", want_a)]
        assert final.content[0].signature == msg.content[0].signature
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events
                 if e.type.startswith("content_block")]
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["thinking", "text"]
        think = kinds[:kinds.index(("content_block_stop", None)) + 1]
        assert think[0][0] == "content_block_start" and think[-2:] == [
            ("content_block_delta", "signature_delta"), ("content_block_stop", None)]
        assert {k for k in think[1:-2]} == {("content_block_delta", "thinking_delta")}


def test_thinking_in_the_history_reaches_the_template(scripted, folder):
    a, eng = scripted
    eng.reply = "ok"
    history = [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "they want a parser", "signature": "sig"},
        {"type": "redacted_thinking", "data": "xyz"}, {"type": "text", "text": "Sure."}]},
        {"role": "user", "content": "Go on."}]
    _an(a.base).messages.create(model="stub", max_tokens=50, messages=history)
    assert "<think>\nthey want a parser\n</think>\n\nSure." in eng.tokenizer.decode(eng.prompts[-1])
    _oa(a.base).chat.completions.create(model="stub", max_tokens=50, messages=[
        *USER, {"role": "assistant", "content": "Sure.", "reasoning_content": "r2"}, {"role": "user", "content": "x"}])
    assert "<think>\nr2\n</think>\n\nSure." in eng.tokenizer.decode(eng.prompts[-1])


def test_request_fields_reach_the_template(scripted, folder):
    a, eng = scripted
    eng.reply = "ok"
    chat = load_chat_tokenizer(folder)

    def prompt() -> str:
        return eng.tokenizer.decode(eng.prompts[-1])

    def want(**kw) -> str:
        return chat.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kw)

    c = _oa(a.base)
    extra = {"k": [1, "two"], "nested": {"x": None}}
    c.chat.completions.create(model="stub", messages=USER, reasoning_effort="low",
                              extra_body={"chat_template_kwargs": {"extra": extra}})
    assert prompt() == want(enable_thinking=True, reasoning_effort="low", extra=extra)
    assert f"[extra={json.dumps(extra)}]" in prompt() and "[effort=low]" in prompt() and prompt().endswith("<think>\n")
    c.chat.completions.create(model="stub", messages=USER, reasoning_effort="none")
    assert prompt().endswith("<think>\n\n</think>\n\n")
    c.chat.completions.create(model="stub", messages=USER, extra_body={"enable_thinking": True})
    assert prompt() == want(enable_thinking=True)
    _an(a.base).messages.create(model="stub", max_tokens=50, messages=USER,
                                thinking={"type": "enabled", "budget_tokens": 20})
    assert prompt() == want(enable_thinking=True)
    _an(a.base).messages.create(model="stub", max_tokens=50, messages=USER, thinking={"type": "disabled"})
    assert prompt() == want(enable_thinking=False)
    # Refusals name the field.
    for body, field in (({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
                        ({"reasoning_effort": "extreme"}, "reasoning_effort")):
        r = httpx.post(a.base + "/v1/chat/completions", json={"messages": USER, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    r = httpx.post(a.base + "/v1/messages", json={"messages": USER, "max_tokens": 10,
                                                  "thinking": {"type": "enabled", "budget_tokens": 10}}, timeout=30)
    assert r.status_code == 400 and "budget_tokens" in r.json()["error"]["message"]
    r = httpx.post(a.base + "/v1/completions", json={"prompt": "x", "reasoning_effort": "low"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


# -- the real engine ------------------------------------------------------------------


def test_a_budget_forces_the_end_marker_with_mtp_on(live):
    a, s = live
    tok = s.api.tokenizer
    end = tok.encode("</think>").ids
    rng = _seed.rng()
    for budget in (int(rng.integers(1, 6)), int(rng.integers(6, 30))):
        r = httpx.post(a.base + "/v1/chat/completions", timeout=120, json={
            "messages": USER, "max_tokens": budget + 20, "temperature": 0, "thinking_token_budget": budget,
            **OPEN}).json()
        msg = r["choices"][0]["message"]
        # The reasoning ended (an answer followed) within its budget (re-encoded: the exact count is below).
        assert msg["content"], r
        assert len(tok.encode(msg["reasoning_content"] or "").ids) <= budget
        assert r["mtp"]["depth"] == 2
    # Without a budget the code model never closes the reasoning: all of it is reasoning.
    r = httpx.post(a.base + "/v1/chat/completions", timeout=120, json={
        "messages": USER, "max_tokens": 24, "temperature": 0, **OPEN}).json()
    assert r["choices"][0]["message"]["content"] == "" and r["choices"][0]["message"]["reasoning_content"]
    # At the engine: the end marker's tokens start at most `budget` tokens in.
    from mtplx_ext.decode.reasoning_gate import ReasoningGate

    budget = int(rng.integers(1, 12))
    gate = ReasoningGate(None, lambda t: tok.decode([t]), "<think>", tok.encode("<think>").ids, "</think>", end,
                         budget=budget)
    req = s.api.engine.submit(tok.encode("def parse(data):\n").ids, max_tokens=budget + 12, constraint=gate)
    req.wait(timeout=120)
    toks = req.tokens
    at = next(i for i in range(len(toks)) if toks[i:i + len(end)] == end)
    assert at <= budget and req.accepted > 0


def test_the_schema_applies_after_the_reasoning(live):
    a, s = live
    c = _oa(a.base)
    rng = _seed.rng()
    for temperature in (0.0, 0.8):
        budget = int(rng.integers(3, 16))
        r = c.chat.completions.create(
            model="think", messages=USER, max_tokens=budget + 80, temperature=temperature, seed=int(rng.integers(1 << 30)),
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}},
            extra_body={"thinking_token_budget": budget, **OPEN})
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg
        assert msg.reasoning_content and not msg.reasoning_content.lstrip().startswith("{")  # free text
        jsonschema.validate(json.loads(msg.content), SCHEMA)
    # A forced tool call, on the Anthropic route with thinking: the call after the reasoning.
    tool = {"name": "get", "input_schema": {"type": "object", "properties": {"k": {"type": "integer"}},
                                            "required": ["k"], "additionalProperties": False}}
    msg = _an(a.base).messages.create(model="think", max_tokens=120, messages=USER, tools=[tool],
                                      tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 8},
                                      extra_body={"temperature": 0})
    assert [b.type for b in msg.content][0] == "thinking" and msg.stop_reason == "tool_use"
    use = next(b for b in msg.content if b.type == "tool_use")
    jsonschema.validate(use.input, tool["input_schema"])


def test_markers_none_and_a_model_without_markers_leave_the_reply_as_it_is(scripted, folder, capsys):
    a, eng = scripted
    eng.reply = "<think>x</think> y"
    api = API(eng, "plain", eng.tokenizer, load_chat_tokenizer(folder), None, (), reasoning_markers="none")
    assert api.reasoning is None
    with AppThread(api) as plain:
        msg = _oa(plain.base).chat.completions.create(model="plain", messages=USER, max_tokens=50).choices[0].message
        assert msg.content == eng.reply and getattr(msg, "reasoning_content", None) is None
        assert "reasoning_content" not in (msg.model_extra or {})
        r = httpx.post(plain.base + "/v1/messages", timeout=30, json={
            "messages": USER, "max_tokens": 50, "thinking": {"type": "enabled", "budget_tokens": 10}})
        assert r.status_code == 400 and "does not reason" in r.json()["error"]["message"]
    from mtplx_ext import cli

    assert cli.main(["serve", "--reasoning-markers", "<r>", "--port", "0"]) == 2
    assert "--reasoning-markers must be auto, none or START,END" in capsys.readouterr().err


def test_a_call_written_in_the_reasoning_is_reasoning_and_the_answer_s_call_is_a_call(scripted):
    a, eng = scripted
    eng.reply = ('<think>maybe <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>?</think>\n'
                 '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>')
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    for stream in (False, True):
        kw = {"model": "stub", "messages": USER, "max_tokens": 200, "tools": [tool],
              "extra_body": {"chat_template_kwargs": {"free": True}}}
        if not stream:
            ch = _oa(a.base).chat.completions.create(**kw).choices[0]
            thought, calls, reason = ch.message.reasoning_content, ch.message.tool_calls, ch.finish_reason
        else:
            parts, calls, reason = [], [], None
            for chunk in _oa(a.base).chat.completions.create(stream=True, **kw):
                for ch in chunk.choices:
                    parts.append(getattr(ch.delta, "reasoning_content", None) or "")
                    calls += ch.delta.tool_calls or []
                    reason = ch.finish_reason or reason
            thought = "".join(parts)
        assert thought == 'maybe <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>?'
        assert reason == "tool_calls" and len([c for c in calls if c.function.name]) == 1
        assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"tz": "UTC"}


def test_a_marker_in_the_user_s_message_opens_no_reasoning(scripted):
    a, eng = scripted
    eng.reply = "It opens a block."
    msg = _oa(a.base).chat.completions.create(model="stub", max_tokens=50, messages=[
        {"role": "user", "content": "What does <think> do?"}], extra_body={"chat_template_kwargs": {"free": True}}
    ).choices[0].message
    assert (msg.content, msg.reasoning_content) == ("It opens a block.", None)
