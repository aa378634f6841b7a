"""The Anthropic Messages API: `POST /v1/messages` (streamed or not) and `/v1/messages/count_tokens`.

A Messages body is translated into the chat route's terms (OpenAI-shaped
messages and tools through the same chat template, the same engine
arguments), and the reply into Anthropic's content blocks: `thinking` (the
model's reasoning, `serve.reasoning`; `thinking` requests reach the template
and the budget), `text` and `tool_use` (cut from the text by the same
`tools.ToolStream` as the chat route); `tool_choice` `any` or `tool` forces
a call through the chat route's call grammar
(`structured.tool_call_constraint`). Streams send Anthropic's
events: `message_start`, `ping`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`
(an `error` event if the request fails). Client mistakes get Anthropic's
error JSON with status 400, before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from mtplx_ext.batching import Event, Request
from mtplx_ext.serve import disconnect, params, reasoning, structured, tools
from mtplx_ext.serve.errors import BadRequest, anthropic_error
from mtplx_ext.serve.openai import Reply, engine_args, mtp_stats

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
#: Messages fields that would change the reply and that this server does not implement.
UNSUPPORTED = ("container", "mcp_servers", "context_management", "output_config")


def _text_blocks(v: Any, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                                   for b in v):
        return "".join(b["text"] for b in v)
    raise BadRequest(f"{where} must be a string or a list of text blocks", where)


def _messages(body: dict) -> list[dict]:
    """Anthropic messages (+ system) as OpenAI-shaped chat messages: tool_use -> tool_calls, tool_result -> tool."""
    out: list[dict] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f'{where}.role must be "user" or "assistant"', "messages")
        c = m.get("content")
        if isinstance(c, str):
            out.append({"role": m["role"], "content": c})
            continue
        if not isinstance(c, list):
            raise BadRequest(f"{where}.content must be a string or a list of content blocks", "messages")
        text, calls, results, thought = [], [], 0, []
        for j, b in enumerate(c):
            kind = b.get("type") if isinstance(b, dict) else None
            bw = f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "thinking" and m["role"] == "assistant" and isinstance(b.get("thinking"), str):
                thought.append(b["thinking"])  # the template's `reasoning_content` (its signature is not checked)
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                continue  # encrypted by another server: nothing a template can show
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise BadRequest(f"{bw}: a tool_use block needs a string name and an object input", "messages")
                calls.append({"id": str(b.get("id") or ""), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise BadRequest(f"{bw}: a tool_result block needs a string tool_use_id", "messages")
                res = b.get("content", "")
                res = _text_blocks(res, f"{bw}.content") if res is not None else ""
                if b.get("is_error"):
                    res = "Error: " + res
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": res})
                results += 1
            else:
                raise BadRequest(f"{bw}: {kind!r} blocks are not supported in {m['role']} messages "
                                 "(text, tool_use from the assistant, tool_result from the user)", "messages")
        if text or calls or not results:  # a message of tool results only is just those
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thought:
                msg["reasoning_content"] = "".join(thought)
            out.append(msg)
    return tools.chat_messages({"messages": out})


def _tools(body: dict) -> tuple[list[dict] | None, Any]:
    """Anthropic tools and tool_choice as the chat route's (OpenAI-shaped tools, choice)."""
    ts = body.get("tools")
    if ts is None:
        ts = []
    if not isinstance(ts, list):
        raise BadRequest("tools must be a list", "tools")
    out = []
    for i, t in enumerate(ts):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not _NAME.match(t["name"]):
            raise BadRequest(f"tools[{i}].name must be 1-128 letters, digits, '_' or '-'", f"tools[{i}].name")
        if t.get("type") not in (None, "custom"):
            raise BadRequest(f"tools[{i}].type {t.get('type')!r}: server tools are not supported", f"tools[{i}].type")
        if not isinstance(t.get("input_schema"), dict):
            raise BadRequest(f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise BadRequest(f"tools[{i}].description must be a string", f"tools[{i}].description")
        f = {"name": t["name"]}
        if t.get("description"):
            f["description"] = t["description"]
        f["parameters"] = t["input_schema"]
        out.append({"type": "function", "function": f})
    tc = body.get("tool_choice")
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if tc is None:
        choice: Any = "auto" if out else "none"
    elif not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "none", "tool"):
        raise BadRequest('tool_choice must be {"type": "auto" | "any" | "none" | "tool"}', "tool_choice")
    elif tc["type"] == "tool":
        choice = {"type": "function", "function": {"name": tc.get("name")}}
    else:
        choice = kinds[tc["type"]]
    try:
        return tools.check_tools({"tools": out, "tool_choice": choice})
    except BadRequest as e:  # the OpenAI-shaped check's message, under Anthropic's field
        raise BadRequest(str(e), "tool_choice" if e.param == "tool_choice" else "tools") from None


def parse_messages(api: Any, body: dict) -> tuple[list[int], dict[str, Any], Reply]:
    """A Messages body's prompt, engine arguments and reply shape (400s name the field)."""
    for name in UNSUPPORTED:
        if body.get(name) is not None and body[name] != {"type": "disabled"}:
            raise BadRequest(f"{name} is not supported", name)
    if body.get("max_tokens") is None:
        raise BadRequest("max_tokens is required", "max_tokens")
    max_tokens = params.integer(body, "max_tokens")
    thinking = reasoning.anthropic_options(body, max_tokens)
    markers = getattr(api, "reasoning", None)  # an API stand-in may have none
    reasoning.check_model(markers, thinking)
    tool_list, choice = _tools(body)
    reply = Reply("chat")
    if choice != "none":
        tc = body.get("tool_choice") or {}
        reply.parse_tools(tool_list, tools.tool_format(api.chat_tokenizer),
                          parallel=not tc.get("disable_parallel_tool_use", False), choice=choice)
    messages = _messages(body)
    text = params.template_text(messages, api.chat_tokenizer, reply.tool_list, thinking.template_kwargs)
    reply.reason(markers, thinking, text, messages)
    prompt = api.tokenizer.encode(text).ids
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop_sequences must be a list of non-empty strings", "stop_sequences")
    sampling = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k") if k in body}
    args = engine_args(api, body, params.submit_args(sampling, "chat", api.eos_ids))
    args["stop"] = stops
    # tool_choice "any" / "tool": the reply is a call, forced by its grammar as on the OpenAI route.
    # With thinking, the call grammar starts where the reasoning ends (Anthropic refuses forced calls then).
    call = structured.tool_call_constraint(reply.tool_list, reply.tool_choice, api)
    args = structured.submit_args(args, reply.constraint(api, call), call)
    return prompt, args, reply


def _stop(api: Any, r: Request, called: bool, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished request."""
    if called and r.finish_reason != "length":
        return "tool_use", None
    if r.finish_reason == "length":
        return "max_tokens", None
    if stops and not (r.tokens and r.tokens[-1] in api.eos_ids):
        rest = api.tokenizer.decode(r.tokens)[len(r.text):]
        hit = next((s for s in stops if rest.startswith(s)), None) or next((s for s in stops if s in rest), None)
        if hit is not None:
            return "stop_sequence", hit
    return "end_turn", None


def _usage(r: Request) -> dict[str, int]:
    return {"input_tokens": len(r.prompt), "output_tokens": len(r.tokens)}


def signature(thinking: str) -> str:
    """A thinking block's `signature`: an opaque digest of its text (Anthropic's are encrypted proofs).

    Clients keep and send back thinking blocks with a non-empty signature;
    the server reads the thinking text back into the template and ignores the
    signature, so it proves nothing and only has to be stable.
    """
    return "sha256:" + hashlib.sha256(thinking.encode()).hexdigest()


def _block(kind: str, p: Any) -> dict:
    if kind == "text":
        return {"type": "text", "text": p}
    if kind == "reasoning":
        return {"type": "thinking", "thinking": p, "signature": signature(p)}
    return {"type": "tool_use", "id": "toolu_" + p["id"].removeprefix("call_"), "name": p["function"]["name"],
            "input": json.loads(p["function"]["arguments"] or "{}")}


async def messages(api: Any, http: HTTPRequest) -> Response:
    """`POST /v1/messages`."""
    try:
        body = await api.body(http)
        prompt, args, reply = parse_messages(api, body)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        r = api.submit(prompt, args, disconnect.deliver(loop, events))
    except BadRequest as e:
        return anthropic_error(e.status, str(e) if e.param is None or e.param in str(e) else f"{e.param}: {e}")
    mid = "msg_" + uuid.uuid4().hex[:24]
    if body.get("stream", False):
        return StreamingResponse(_sse(api, r, events, mid, reply, args["stop"]), media_type="text/event-stream")
    ev = await disconnect.finished(http.receive, events, r)
    if ev is None:
        return Response(status_code=499)  # nobody reads it
    if ev.kind == "error":
        return anthropic_error(500, f"the request failed: {ev.error}")
    pieces = reply.pieces(r.text) + reply.finish()
    content: list[dict] = []
    thought = "".join(p for k, p in pieces if k == "reasoning")
    if thought:  # the reasoning comes first, as one block
        content.append(_block("reasoning", thought))
    for k, p in pieces:  # adjacent text joins into one block
        if k == "reasoning":
            continue
        if k == "text" and content and content[-1]["type"] == "text":
            content[-1]["text"] += p
        elif k == "call" or p:
            content.append(_block(k, p))
    if reply.n_calls:  # whitespace around the calls is not a text block
        content = [b for b in content if b["type"] != "text" or b["text"].strip()]
    reason, seq = _stop(api, r, reply.n_calls > 0, args["stop"])
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": api.model_name,
                         "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": _usage(r),
                         "mtp": mtp_stats(r, api.engine)})


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _sse(api: Any, r: Request, events: asyncio.Queue, mid: str, reply: Reply, stops: list[str]
               ) -> AsyncIterator[str]:
    index = -1
    open_text = False  # a text block is open at `index`
    thought: list[str] = []  # the open thinking block's text (at `index`); empty when none is open

    def close_thinking() -> list[str]:
        nonlocal thought
        if not thought:
            return []
        sig = signature("".join(thought))
        thought = []
        return [_event("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": sig}}),
                _event("content_block_stop", {"index": index})]

    def emit(pieces: list[tuple[str, Any]]) -> list[str]:
        nonlocal index, open_text
        out = []
        for k, p in pieces:
            if k == "reasoning":
                if not thought:
                    index += 1
                    out.append(_event("content_block_start", {"index": index, "content_block": {
                        "type": "thinking", "thinking": "", "signature": ""}}))
                thought.append(p)
                out.append(_event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                                     "thinking": p}}))
                continue
            out += close_thinking()
            if k == "text":
                if not p or (not open_text and not p.strip() and reply.fmt is not None):
                    continue  # whitespace between tool calls opens no block
                if not open_text:
                    index += 1
                    open_text = True
                    out.append(_event("content_block_start", {"index": index, "content_block": _block("text", "")}))
                out.append(_event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": p}}))
                continue
            if open_text:
                out.append(_event("content_block_stop", {"index": index}))
                open_text = False
            index += 1
            block = _block(k, p)
            out.append(_event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}))
            out.append(_event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
            out.append(_event("content_block_stop", {"index": index}))
        return out

    try:
        yield _event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": api.model_name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(r.prompt), "output_tokens": 0}}})
        yield _event("ping", {})
        while True:
            ev = await events.get()
            if ev.kind == "tokens" and ev.text:
                for s in emit(reply.pieces(ev.text)):
                    yield s
            elif ev.kind == "done":
                for s in emit(reply.finish()) + close_thinking():
                    yield s
                if open_text:
                    yield _event("content_block_stop", {"index": index})
                reason, seq = _stop(api, r, reply.n_calls > 0, stops)
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                               "usage": {"output_tokens": len(r.tokens)},
                                               "mtp": mtp_stats(r, api.engine)})
                yield _event("message_stop", {})
                break
            elif ev.kind == "error":
                yield _event("error", {"error": {"type": "api_error", "message": f"the request failed: {ev.error}"}})
                break
    finally:
        if not r.done:
            r.cancel()


async def count_tokens(api: Any, http: HTTPRequest) -> Response:
    """`POST /v1/messages/count_tokens`: the prompt's token count (the template with the tools)."""
    try:
        body = await api.body(http)
        tool_list, choice = _tools(body)
        msgs = _messages(body)
        kw = reasoning.anthropic_options(body, params.integer(body, "max_tokens") or 1 << 62).template_kwargs
        prompt = params.template_prompt(msgs, api.tokenizer, api.chat_tokenizer, tool_list if choice != "none" else None,
                                        kw)
    except BadRequest as e:
        return anthropic_error(400, str(e))
    return JSONResponse({"input_tokens": len(prompt)})


__all__ = ["UNSUPPORTED", "count_tokens", "messages", "parse_messages"]
