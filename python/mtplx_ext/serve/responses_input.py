"""The Responses API's request side: fields, input items, tools and `text.format` in the chat route's terms.

A `/v1/responses` body is translated into what `/v1/chat/completions`
already decodes: OpenAI-shaped chat messages (through the same chat
template), nested function tools (checked by `tools.check_tools`), the chat
`tool_choice`, a `response_format` for `structured.constraint`, and the same
sampling arguments (`params.submit_args`). Each refusal is a `BadRequest`
naming the Responses field (`input[2].content[0]`, `tools[1].type`,
`text.format`), not the chat field it was translated into, so a client sees
its own mistake.

`reasoning: {effort, summary}` is the chat route's `reasoning_effort`
(`reasoning_options`: the same template arguments and budget). Fields this
server cannot honour (`background: true`, hosted tools, `include` values
other than the text's logprobs, ...) are refused by
`check_unsupported` rather than ignored; fields that ask for nothing here
(`store`, `metadata`, `user`, `prompt_cache_key`, `safety_identifier`,
`truncation: "disabled"`) are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mtplx_ext.serve import params, reasoning, tools
from mtplx_ext.serve.errors import BadRequest

#: Roles an input message may have.
INPUT_ROLES = ("user", "system", "developer", "assistant")
#: Text content part types (input parts from the client, output parts of earlier replies).
TEXT_PARTS = ("input_text", "output_text")
#: Most output tokens when the request sets no `max_output_tokens` (capped by what the context leaves).
DEFAULT_MAX_OUTPUT_TOKENS = 4096
#: The `include` value that asks for the output text's logprobs (the one this server supports).
LOGPROBS = "message.output_text.logprobs"
#: The sampling fields the chat route reads that a Responses body may carry too (extensions, as vLLM's).
SAMPLING_FIELDS = (*params.FLOAT_FIELDS, "top_k", "seed", "stop", "logit_bias")


def _absent(v: Any) -> bool:
    return v is None


#: Fields refused (400 naming the field) unless their value asks for nothing.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "background": (lambda v: v is None or v is False, "background responses are not supported"),
    "background_options": (_absent, "background_options is not supported"),
    "conversation": (_absent, "conversation (the Conversations API) is not supported; use previous_response_id"),
    "prompt": (_absent, "prompt (stored prompt templates) is not supported"),
    "context_management": (_absent, "context_management is not supported"),
    "max_tool_calls": (_absent, "max_tool_calls is not supported"),
    "moderation": (_absent, "moderation is not supported"),
    "image": (_absent, "image is not supported"),
    "access_programs": (_absent, "access_programs is not supported"),
    "prompt_cache_options": (_absent, "prompt_cache_options is not supported"),
    "prompt_cache_retention": (lambda v: v in (None, "in_memory"), 'prompt_cache_retention must be "in_memory"'),
    "truncation": (lambda v: v in (None, "disabled"), 'truncation "auto" is not supported (the prompt must fit)'),
    "service_tier": (lambda v: v in (None, "auto", "default"), 'service_tier must be "auto" or "default"'),
    "n": (lambda v: v in (None, 1), "n must be 1"),
}
#: `reasoning.summary` values (OpenAI's): accepted, and answered with `summary: []` (no summaries are written).
SUMMARIES = ("auto", "concise", "detailed")
#: The chat route's reasoning extensions a Responses body may carry too (`reasoning.openai_options` reads them).
REASONING_FIELDS = ("enable_thinking", "thinking_token_budget", "chat_template_kwargs")
#: Chat-route names a Responses body must not use (it has its own).
CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
              "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def check_unsupported(body: dict) -> None:
    """Refuses (400 naming it) a field set to something this server would have to do and cannot."""
    for name, (ok, why) in UNSUPPORTED.items():
        if name in body and not ok(body[name]):
            raise BadRequest(why, name)
    for name, own in CHAT_NAMES.items():
        if body.get(name) is not None:
            raise BadRequest(f"{name} is a Chat Completions field; /v1/responses takes {own}", name)
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise BadRequest("include must be a list of strings", "include")
        for x in include:
            if x != LOGPROBS:
                raise BadRequest(f"include {x!r} is not supported (only {LOGPROBS!r})", "include")
    for name in ("store", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BadRequest(f"{name} must be a boolean", name)
    for name in ("instructions", "previous_response_id", "user", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"{name} must be a string", name)
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
                             or len(meta) > 16):
        raise BadRequest("metadata must be an object of at most 16 string values", "metadata")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_obfuscation"}:
            raise BadRequest("stream_options may only hold include_obfuscation", "stream_options")
        if not body.get("stream", False):
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")


# -- input items -> chat messages ----------------------------------------------------


def _text(content: Any, path: str, role: str) -> str:
    """Content at `path` (a string, or text parts) as one string; other parts (images, files) are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{path} must be a string or a list of content parts", path)
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        pw = f"{path}[{j}]"
        if kind in TEXT_PARTS or (kind == "refusal" and role == "assistant"):
            text = p.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise BadRequest(f"{pw}.text must be a string", pw)
            out.append(text)
        else:
            raise BadRequest(f"{pw}: {kind!r} content parts are not supported (text parts only)", pw)
    return "".join(out)


def _arguments(item: dict, where: str) -> dict:
    args = item.get("arguments", "")
    if not isinstance(args, str):
        raise BadRequest(f"{where}.arguments must be a JSON string", f"{where}.arguments")
    try:
        parsed = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
        raise BadRequest(f"{where}.arguments is not valid JSON", f"{where}.arguments") from None
    if not isinstance(parsed, dict):
        raise BadRequest(f"{where}.arguments must hold a JSON object", f"{where}.arguments")
    return parsed


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The body's `input` (a string, or a list of items) as chat messages (OpenAI's chat shape).

    Items: messages (`{"role", "content"}`, typed `"message"` or not) with
    string or text-part content; `function_call` (consecutive calls, and the
    assistant text before them, make one assistant turn with `tool_calls`, as
    chat templates render them); `function_call_output` (a `tool` message);
    `reasoning` items (their `reasoning_text` content) become the
    `reasoning_content` of the assistant turn after them, as the chat route's
    history carries it (the template renders or drops it; a summary or
    encrypted content alone gives nothing to render). `developer` messages
    become `system` ones: chat templates know that role.
    """
    if isinstance(value, str):
        if not value:
            raise BadRequest("input is empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise BadRequest("input must be a string or a list of input items", "input")
    out: list[dict[str, Any]] = []
    thought: list[str] = []  # reasoning items waiting for the assistant turn they precede

    def turn(content: str) -> dict[str, Any]:
        """A new assistant message, carrying the reasoning before it."""
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if thought:
            msg["reasoning_content"] = "\n\n".join(thought)
            thought.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if thought and kind not in ("reasoning", "function_call") and item.get("role") != "assistant":
            turn("")  # reasoning with no reply after it (a reply cut inside its reasoning)
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise BadRequest(f"{where}.role must be one of {', '.join(INPUT_ROLES)}; got {role!r}",
                                 f"{where}.role")
            text = _text(item.get("content"), f"{where}.content", role)
            if role == "assistant":
                turn(text)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"{where}.name must be a non-empty string", f"{where}.name")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(item, where)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not thought:
                last.setdefault("tool_calls", []).append(call)
            else:
                turn("")["tool_calls"] = [call]
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{where}.output", "tool")})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                thought.append(text)
        else:
            raise BadRequest(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output)", f"{where}.type")
    if thought:
        turn("")
    if not out:
        raise BadRequest("input holds no messages", "input")
    return out


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's `reasoning_text` parts, joined ("" when it has none: a summary is not the reasoning)."""
    content = item.get("content")
    if content is None:
        return ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a list of reasoning_text parts", f"{where}.content")
    out = []
    for j, p in enumerate(content):
        pw = f"{where}.content[{j}]"
        if not isinstance(p, dict) or p.get("type") != "reasoning_text" or not isinstance(p.get("text"), str):
            raise BadRequest(f"{pw} must be a reasoning_text part with its text", pw)
        out.append(p["text"])
    return "".join(out)


def lead_system(messages: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """`instructions` and the leading system messages as one system message first (the form templates expect)."""
    head, k = [], 0
    if instructions:
        head.append(instructions)
    while k < len(messages) and messages[k]["role"] == "system":
        head.append(messages[k]["content"])
        k += 1
    return ([{"role": "system", "content": "\n\n".join(head)}] if head else []) + messages[k:]


# -- tools, tool_choice, text.format -----------------------------------------------------


def chat_tools(body: dict) -> tuple[list[dict] | None, Any]:
    """The body's flat function tools and `tool_choice` as the chat route's, checked (`tools.check_tools`).

    Hosted tools (web_search, file_search, computer_use, code_interpreter,
    mcp, ...) and tool choices that name them get a 400 naming the field.
    """
    ts = body.get("tools")
    nested = None
    if ts is not None:
        if not isinstance(ts, list):
            raise BadRequest("tools must be a list of tool objects", "tools")
        nested = []
        for i, t in enumerate(ts):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise BadRequest(f"tools[{i}]: tools of type {kind!r} are not supported (function tools only)",
                                 f"tools[{i}].type")
            f = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            nested.append({"type": "function", "function": f})
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        if tc.get("type") != "function" or not isinstance(tc.get("name"), str):
            raise BadRequest(f"tool_choice {tc!r} is not supported "
                             '("auto", "none", "required" or {"type": "function", "name": ...})', "tool_choice")
        tc = {"type": "function", "function": {"name": tc["name"]}}
    elif tc is not None and not isinstance(tc, str):
        raise BadRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                         "tool_choice")
    try:
        return tools.check_tools({"tools": nested, "tool_choice": tc})
    except BadRequest as e:  # the nested shape's names (tools[i].function.name), in the flat shape's terms
        param = (e.param or "tools").replace(".function", "")
        msg = str(e) if e.param == "tool_choice" else str(e).replace(".function", "")
        raise BadRequest(msg, param) from None


def response_format(body: dict) -> dict | None:
    """`text.format` as the chat route's `response_format` (what `structured.constraint` reads), or None."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise BadRequest("text must be an object with format (and verbosity)", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise BadRequest('text.verbosity is not supported (only "medium", the default)', "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequest("text.format must be an object with a type", "text.format")
    if fmt["type"] in ("text", "json_object"):
        return {"type": fmt["type"]}
    if fmt["type"] != "json_schema":
        raise BadRequest(f"text.format.type must be text, json_object or json_schema, got {fmt['type']!r}",
                         "text.format")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def reasoning_options(body: dict) -> tuple[reasoning.Thinking, dict[str, Any]]:
    """The body's `reasoning` as the chat route's `Thinking`, and the `reasoning` object its response echoes.

    `effort` is the chat route's `reasoning_effort` (`reasoning.openai_options`:
    "none" turns thinking off, the others on with their budget, and the value
    reaches the template), so both routes steer a model alike; the chat
    route's `enable_thinking`, `thinking_token_budget` and
    `chat_template_kwargs` are read too (extensions). `summary` (or its
    deprecated name `generate_summary`) takes OpenAI's values and is accepted,
    but no summary is written: the reasoning item carries the whole text.
    `context` other than "auto" and `mode` other than "standard" ask for what
    this server does not do (the template decides which earlier reasoning it
    renders) and are refused.
    """
    r = body.get("reasoning")
    r = {} if r is None else r
    if not isinstance(r, dict):
        raise BadRequest("reasoning must be an object", "reasoning")
    extra = sorted(set(r) - {"effort", "summary", "generate_summary", "context", "mode"})
    if extra:
        raise BadRequest(f"reasoning.{extra[0]} is not supported", f"reasoning.{extra[0]}")
    effort = r.get("effort")
    if effort is not None and effort not in reasoning.EFFORT_BUDGET:
        raise BadRequest(f"reasoning.effort must be one of {', '.join(reasoning.EFFORT_BUDGET)}, got {effort!r}",
                         "reasoning.effort")
    for name in ("summary", "generate_summary"):
        if r.get(name) not in (None, *SUMMARIES):
            raise BadRequest(f"reasoning.{name} must be one of {', '.join(SUMMARIES)}", f"reasoning.{name}")
    if r.get("context") not in (None, "auto"):
        raise BadRequest('reasoning.context must be "auto" (the chat template decides which earlier reasoning it '
                         "renders)", "reasoning.context")
    if r.get("mode") not in (None, "standard"):
        raise BadRequest('reasoning.mode must be "standard"', "reasoning.mode")
    chat = {k: body[k] for k in REASONING_FIELDS if k in body}
    if effort is not None:
        chat["reasoning_effort"] = effort
    th = reasoning.openai_options(chat)
    if th.field == "reasoning_effort":
        th.field = "reasoning.effort"
    summary = r.get("summary") if r.get("summary") is not None else r.get("generate_summary")
    return th, {"effort": effort, "summary": summary}


def sampling(body: dict, default_max: int | None) -> dict[str, Any]:
    """The chat route's sampling fields of a Responses body, with `max_output_tokens` as its `max_tokens`.

    `include: ["message.output_text.logprobs"]` with `top_logprobs` (0..20)
    is the chat route's `logprobs: true` with its `top_logprobs`.
    """
    out = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    top = body.get("top_logprobs")
    if LOGPROBS in (body.get("include") or []):
        out["logprobs"] = True
        out["top_logprobs"] = top
    elif top not in (None, 0):
        raise BadRequest(f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
    m = params.integer(body, "max_output_tokens")
    if m is not None and m < 1:
        raise BadRequest("max_output_tokens must be >= 1", "max_output_tokens")
    out["max_tokens"] = m if m is not None else default_max
    return out


__all__ = ["CHAT_NAMES", "DEFAULT_MAX_OUTPUT_TOKENS", "INPUT_ROLES", "LOGPROBS", "SAMPLING_FIELDS", "TEXT_PARTS",
           "REASONING_FIELDS", "SUMMARIES", "UNSUPPORTED", "chat_tools", "check_unsupported", "input_messages",
           "lead_system", "reasoning_options", "response_format", "sampling"]
