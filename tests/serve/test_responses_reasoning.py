"""Reasoning models on the OpenAI Responses API (`/v1/responses`), with the official openai client.

A scripted engine (tests/_serve.py) writes replies with `<think>` markers
(several tokens each in the shipped tokenizer, so its random chunks cut them
anywhere): the response's first item is a `reasoning` item holding exactly
the reasoning an independent oracle finds (`test_reasoning_splitter.oracle`),
`output_text` holds the answer only, `reasoning_tokens` equals the tokens up
to the end marker (found by decoding prefixes, not by the server's windowed
count), and the stream's `reasoning_text` deltas rebuild the same item.
`reasoning.effort` reaches the test template exactly as the chat route's
`reasoning_effort` does (the chat route is the peer oracle), reasoning items
sent back reach it as the assistant's `reasoning_content`, and a model
without markers answers as the chat route does. The shipped model, which
never closes a reasoning block itself, shows a JSON schema applying to the
answer after the reasoning only.
"""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from tokenizers import Tokenizer

import _seed

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from _reasoning import SCHEMA, folder, live, scripted  # noqa: E402,F401  (fixtures)
from _serve import AppThread  # noqa: E402
from _reasoning import reply_text as _reply  # noqa: E402
from test_reasoning_splitter import oracle  # noqa: E402
from test_responses import _raw_stream, check_events  # noqa: E402

from mtplx_ext.decode.reasoning_gate import ReasoningGate  # noqa: E402
from mtplx_ext.serve import API, load_chat_tokenizer  # noqa: E402
from mtplx_ext.serve.responses_output import Output, output_text, reasoning_text  # noqa: E402

PROMPT = "def parse(data):"
USER = [{"role": "user", "content": PROMPT}]


def _oa(base: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)


def reasoning_tokens(tok: Tokenizer, reply: str, has_block: bool) -> int:
    """The tokens of `reply` up to the one completing the first end marker (all when none), by decoding prefixes."""
    if not has_block:
        return 0
    ids = tok.encode(reply).ids
    return next((k for k in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:k])), len(ids))


def check_reasoning(resp: dict, want_r: str, want_a: str, want_tokens: int, status: str = "completed") -> None:
    """Asserts a response's reasoning item (first, alone), answer text and reasoning token count."""
    items = resp["output"]
    if want_r:
        first = items[0]
        assert first["type"] == "reasoning" and first["summary"] == [] and first["status"] == status, first
        assert first["content"] == [{"type": "reasoning_text", "text": want_r}] and first["id"].startswith("rs_")
        items = items[1:]
    assert all(it["type"] != "reasoning" for it in items), resp["output"]
    assert output_text(items) == want_a and reasoning_text(resp["output"]) == want_r
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == want_tokens


CASES = [  # (request fields, how the model writes its reply, the prompt opened the reasoning)
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "{r}\n</think>\n\n{a}", True),
    ({"chat_template_kwargs": {"free": True}}, "<think>\n{r}</think>{a}", False),
    ({}, "{r}<think>{a}", False),  # the prompt closed the reasoning and the reply opens none: all text
]


@pytest.mark.parametrize("fields, shape, opened", CASES)
def test_the_reasoning_item_streamed_and_not(scripted, fields, shape, opened):
    a, eng = scripted
    rng = _seed.rng()
    c = _oa(a.base)
    for _ in range(3):
        eng.reply = shape.format(r=_reply(rng) + "r", a=_reply(rng) + "a")
        want_r, want_a = oracle(eng.reply, opened)
        n = reasoning_tokens(eng.tokenizer, eng.reply, opened or "<think>" in shape[:8])
        body = {"model": "stub", "input": PROMPT, "max_output_tokens": 400, **fields}
        whole = httpx.post(a.base + "/v1/responses", json=body, timeout=60).json()
        check_reasoning(whole, want_r, want_a, n)
        r = c.responses.create(**{k: v for k, v in body.items() if k in ("model", "input", "max_output_tokens",
                                                                              "reasoning")},
                               extra_body={k: v for k, v in body.items() if k == "chat_template_kwargs"})
        assert r.output_text == want_a and r.usage.output_tokens_details.reasoning_tokens == n
        if want_r:
            assert r.output[0].type == "reasoning" and [p.text for p in r.output[0].content] == [want_r]
        events = _raw_stream(a.base, body)
        final = check_events(events)
        check_reasoning(final, want_r, want_a, n)
        deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
        assert "".join(deltas) == want_r and all(deltas)

        def strip_ids(items: list[dict]) -> list[dict]:
            return [{k: v for k, v in it.items() if k != "id"} for it in items]

        assert strip_ids(final["output"]) == strip_ids(whole["output"])
        assert final["usage"]["output_tokens_details"] == whole["usage"]["output_tokens_details"]
        # The official client's stream helper rebuilds the same response from the events.
        with c.responses.stream(model="stub", input=PROMPT, max_output_tokens=400,
                                reasoning=fields.get("reasoning"),
                                extra_body={k: v for k, v in fields.items() if k != "reasoning"}) as s:
            kinds = [e.type for e in s]
            got = s.get_final_response()
        assert got.output_text == want_a and reasoning_text(got.model_dump()["output"]) == want_r
        assert ("response.reasoning_text.delta" in kinds) == bool(want_r)
    # The chat route splits the same reply the same way and counts the same reasoning tokens.
    chat = httpx.post(a.base + "/v1/chat/completions", timeout=60, json={
        "model": "stub", "messages": USER, "max_tokens": 400,
        **({"reasoning_effort": "low"} if "reasoning" in fields else fields)}).json()
    assert (chat["choices"][0]["message"]["reasoning_content"] or "", chat["choices"][0]["message"]["content"]) == (
        want_r, want_a)
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}


def test_a_reply_cut_in_its_reasoning_and_a_call_after_it(scripted):
    a, eng = scripted
    c = _oa(a.base)
    low = {"model": "stub", "input": PROMPT, "reasoning": {"effort": "low"}}
    # Cut by max_output_tokens inside the reasoning: the reasoning item alone, incomplete, all tokens reasoning.
    eng.reply = "step one, step two, step three\n</think>\n\nanswer"
    whole = httpx.post(a.base + "/v1/responses", json={**low, "max_output_tokens": 3}, timeout=60).json()
    final = check_events(_raw_stream(a.base, {**low, "max_output_tokens": 3}))
    for resp in (whole, final):
        assert resp["status"] == "incomplete" and [it["type"] for it in resp["output"]] == ["reasoning"]
        want = eng.tokenizer.decode(eng.tokenizer.encode(eng.reply).ids[:3]).strip()
        check_reasoning(resp, want, "", 3, "incomplete")
    # Reasoning, then a call: a reasoning item and a function_call item; sent back, one assistant turn.
    args = {"tz": f"UTC+{_seed.rng().integers(12)}"}
    call = json.dumps({"name": "now", "arguments": args})
    eng.reply = f"thinking about time\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    tool = {"type": "function", "name": "now", "parameters": {"type": "object"}}
    r = c.responses.create(**low, tools=[tool])
    final = check_events(_raw_stream(a.base, {**low, "tools": [tool]}))
    for items in (r.model_dump()["output"], final["output"]):
        assert [it["type"] for it in items] == ["reasoning", "function_call"]
        assert reasoning_text(items) == "thinking about time" and json.loads(items[1]["arguments"]) == args
    eng.reply = "ok"
    c.responses.create(**{**low, "input": [*USER, *[it.model_dump(exclude_none=True) for it in r.output],
                                           {"type": "function_call_output", "call_id": r.output[1].call_id,
                                            "output": "noon"}]}, tools=[tool])
    assert "<think>\nthinking about time\n</think>" in eng.tokenizer.decode(eng.prompts[-1])


def test_the_reasoning_check_rejects_broken_responses():
    """The checks above fail on a response that leaves the reasoning in its text, misplaces it or miscounts it."""
    out = Output()
    evs = [out.event("response.created", response={"id": "r"}), out.event("response.in_progress", response={"id": "r"})]
    evs += out.push([("reasoning", "think "), ("reasoning", "hard"), ("text", "Hi")]) + out.push([("text", "!")])
    evs += out.close()
    usage = {"output_tokens_details": {"reasoning_tokens": 5}}
    evs.append(out.event("response.completed", response={"id": "r", "output": out.items, "usage": usage}))
    check_reasoning(check_events(evs), "think hard", "Hi!", 5)
    good = evs[-1]["response"]
    leaked = copy.deepcopy(good)  # the reasoning left in output_text too
    leaked["output"][1]["content"][0]["text"] = "<think>think hard</think>Hi!"
    late = copy.deepcopy(good)  # the reasoning after the message
    late["output"].reverse()
    miscounted = copy.deepcopy(good)
    miscounted["usage"]["output_tokens_details"]["reasoning_tokens"] = 0
    for bad in (leaked, late, miscounted):
        with pytest.raises(AssertionError):
            check_reasoning(bad, "think hard", "Hi!", 5)
    # A stream whose reasoning comes after its message is refused by the event check.
    out = Output()
    evs = [out.event("response.created", response={"id": "r"}), out.event("response.in_progress", response={"id": "r"})]
    evs += out.push([("text", "Hi")]) + out.close()
    evs += out.push([("reasoning", "late")]) + out.close()
    evs.append(out.event("response.completed", response={"id": "r", "output": out.items}))
    with pytest.raises(AssertionError):
        check_events(evs)


def test_effort_and_summary_reach_the_template_as_the_chat_route_s(scripted, folder):
    a, eng = scripted
    eng.reply = "ok"
    chat = load_chat_tokenizer(folder)
    c = _oa(a.base)

    def prompt() -> str:
        return eng.tokenizer.decode(eng.prompts[-1])

    for effort in ("none", "minimal", "low", "medium", "high", "xhigh"):
        for summary in (None, "auto", "concise", "detailed"):
            r = c.responses.create(model="stub", input=PROMPT, reasoning={"effort": effort, "summary": summary})
            assert r.reasoning.effort == effort and r.reasoning.summary == summary
            got = prompt()
            assert got == chat.apply_chat_template(USER, tokenize=False, add_generation_prompt=True,
                                                   enable_thinking=effort != "none", reasoning_effort=effort)
            c.chat.completions.create(model="stub", messages=USER, reasoning_effort=effort)
            assert prompt() == got  # the chat route's prompt for the same effort
        want = {"minimal": 256, "low": 1024, "medium": 4096}.get(effort)  # reasoning.EFFORT_BUDGET's
        assert [getattr(g, "budget", None) for g in eng.constraints[-2:]] == [want, want], effort  # both routes
    assert prompt().endswith("[effort=xhigh]<think>\n")
    c.responses.create(model="stub", input=PROMPT, reasoning={"effort": "none"})
    assert prompt().endswith("<think>\n\n</think>\n\n")
    # The summary is accepted and none is written: the reasoning item carries the whole text.
    eng.reply = "it parses\n</think>\n\ndone"
    r = c.responses.create(model="stub", input=PROMPT, reasoning={"effort": "high", "summary": "detailed"})
    assert r.output[0].summary == [] and r.output[0].content[0].text == "it parses" and r.output_text == "done"


def test_reasoning_items_sent_back_reach_the_template(scripted, folder):
    a, eng = scripted
    chat = load_chat_tokenizer(folder)
    c = _oa(a.base)
    rng = _seed.rng()
    thought, answer = f"they want {rng.integers(1000)} parsers", f"Sure {rng.integers(100)}."
    eng.reply = f"<think>{thought}</think>{answer}"
    free = {"chat_template_kwargs": {"free": True}}
    first = c.responses.create(model="stub", input=PROMPT, extra_body=free)
    assert first.output[0].type == "reasoning"
    history = [*USER, {"role": "assistant", "content": answer, "reasoning_content": thought},
               {"role": "user", "content": "Go on."}]
    want = chat.apply_chat_template(history, tokenize=False, add_generation_prompt=True, free=True)
    assert f"<think>\n{thought}\n</think>\n\n{answer}" in want
    eng.reply = "ok"
    # Stateless: the output items sent back as input (as the client's `output` dumps them).
    items = [{"role": "user", "content": PROMPT}, *[it.model_dump(exclude_none=True) for it in first.output],
             {"role": "user", "content": "Go on."}]
    c.responses.create(model="stub", input=items, extra_body=free)
    assert eng.tokenizer.decode(eng.prompts[-1]) == want
    # Through previous_response_id.
    c.responses.create(model="stub", input="Go on.", previous_response_id=first.id, extra_body=free)
    assert eng.tokenizer.decode(eng.prompts[-1]) == want
    # The chat route's history gives the same prompt.
    c.chat.completions.create(model="stub", messages=history, extra_body=free)
    assert eng.tokenizer.decode(eng.prompts[-1]) == want
    # Reasoning before a call, and reasoning with no reply after it (a reply cut inside it), keep their turns.
    call = {"type": "function_call", "name": "now", "call_id": "c1", "arguments": "{}"}
    rs = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}
    c.responses.create(model="stub", extra_body=free, input=[
        *USER, rs, call, {"type": "function_call_output", "call_id": "c1", "output": "noon"}, rs,
        {"role": "user", "content": "and?"}])
    got = eng.tokenizer.decode(eng.prompts[-1])
    assert got.count("<think>\nhm\n</think>") == 2, got


def test_a_model_without_markers_answers_as_the_chat_route(scripted, folder):
    a, eng = scripted
    eng.reply = "<think>x</think> y"
    api = API(eng, "plain", eng.tokenizer, load_chat_tokenizer(folder), None, (), reasoning_markers="none")
    with AppThread(api) as plain:
        for effort in ("low", "high"):
            r = httpx.post(plain.base + "/v1/responses", timeout=30,
                           json={"input": PROMPT, "reasoning": {"effort": effort}})
            ch = httpx.post(plain.base + "/v1/chat/completions", timeout=30,
                            json={"messages": USER, "reasoning_effort": effort})
            assert r.status_code == ch.status_code == 400
            assert r.json()["error"]["param"] == "reasoning.effort"
            assert ch.json()["error"]["param"] == "reasoning_effort"
            assert "does not reason" in r.json()["error"]["message"]
        r = _oa(plain.base).responses.create(model="plain", input=PROMPT, reasoning={"effort": "none"})
        p = eng.tokenizer.decode(eng.prompts[-1])
        msg = _oa(plain.base).chat.completions.create(model="plain", messages=USER, reasoning_effort="none")
        assert eng.tokenizer.decode(eng.prompts[-1]) == p and p.endswith("<think>\n\n</think>\n\n")
        assert r.output_text == msg.choices[0].message.content == eng.reply  # left as it is
        assert [it.type for it in r.output] == ["message"] and r.usage.output_tokens_details.reasoning_tokens == 0
        assert msg.usage.completion_tokens_details is None  # no reasoning to count


def test_json_schema_with_reasoning_is_gated_after_it(scripted):
    a, eng = scripted
    eng.reply = '{"n": 1, "ok": true}'
    fmt = {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}
    _oa(a.base).responses.create(model="stub", input=PROMPT, reasoning={"effort": "high"}, text={"format": fmt})
    gate = eng.constraints[-1]
    assert isinstance(gate, ReasoningGate) and gate.inner is not None and gate.phase == "reasoning"
    _oa(a.base).responses.create(model="stub", input=PROMPT, text={"format": fmt})
    gate = eng.constraints[-1]  # the prompt closed the reasoning, and "<think>" is several tokens: the grammar at once
    assert isinstance(gate, ReasoningGate) and gate.inner is not None and gate.phase == "answer"


# -- the real engine ------------------------------------------------------------------


def test_the_schema_applies_after_the_reasoning(live):
    a, s = live
    c = _oa(a.base)
    rng = _seed.rng()
    fmt = {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}
    budget = int(rng.integers(3, 16))
    body = dict(model="think", input=PROMPT, max_output_tokens=budget + 80, temperature=0,
                reasoning={"effort": "high"}, text={"format": fmt}, include=["message.output_text.logprobs"],
                extra_body={"thinking_token_budget": budget})
    r = c.responses.create(**body)
    assert r.status == "completed" and r.output[0].type == "reasoning", r
    thought = r.output[0].content[0].text
    assert thought and not thought.lstrip().startswith("{")  # free text
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    n = r.usage.output_tokens_details.reasoning_tokens
    assert 0 < n <= budget + len(s.api.tokenizer.encode("</think>").ids) and n < r.usage.output_tokens
    # The logprobs are the answer's tokens' only (the reasoning's wrote no output_text).
    lp = r.output[1].content[0].logprobs
    assert len(lp) == r.usage.output_tokens - n and "".join(e.token for e in lp).startswith(r.output_text), lp
    with c.responses.stream(**body) as st:
        deltas = [e.logprobs for e in st if e.type == "response.output_text.delta"]
        final = st.get_final_response()
    assert final.output_text == r.output_text and final.output[0].content[0].text == thought  # greedy: the same
    sent = [e.model_dump() for d in deltas for e in d]  # (a stop token's entry has no delta: the part holds it)
    assert [e.model_dump() for e in final.output[1].content[0].logprobs] == [e.model_dump() for e in lp]
    assert sent == [e.model_dump() for e in lp][:len(sent)] and len(sent) >= len(lp) - 1
