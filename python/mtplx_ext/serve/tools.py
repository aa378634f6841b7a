"""Tool calling: `tools` / `tool_choice` checks, chat messages of a tool loop, and tool calls in the reply.

The model writes a call in its family's text format; for Qwen-style templates
(and the shipped tokenizer, whose template names none) that is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The format and its
parser are mlx-lm's (`mlx_lm.tool_parsers`, chosen by mlx-lm's tokenizer
wrapper from the chat template), so a family mlx-lm knows is parsed as it
parses it. `ToolStream` cuts the calls out of the text as it streams, holding
back only what could still become a call marker, so plain text streams as
before.

`forced_call_schema` and `ToolFormat.prefix` / `suffix` describe what a
`required` or named `tool_choice` must produce (the JSON of the call between
the family's markers), for a grammar that forces it (`serve.structured`).
Every function's `parameters` is checked against the JSON Schema metaschema
here, once for both APIs, so a grammar is never built from a broken schema.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtplx_ext.serve.errors import BadRequest

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call text: `start` + call + `end`, read back by `parse(text, tools)`.

    `prefix` / `suffix` are what a forced call is wrapped in (the markers with
    the newlines the family's template writes around the JSON).
    """

    start: str
    end: str
    parse: Callable[[str, Any], Any]
    prefix: str
    suffix: str


def tool_format(chat_tokenizer: Any) -> ToolFormat:
    """The tool-call format of a chat tokenizer: mlx-lm's inferred parser, else the Qwen-style JSON one."""
    if chat_tokenizer is not None and getattr(chat_tokenizer, "has_tool_calling", False):
        start, end = chat_tokenizer.tool_call_start, chat_tokenizer.tool_call_end
        return ToolFormat(start, end, chat_tokenizer.tool_parser, start + "\n", "\n" + end)
    from mlx_lm.tool_parsers import json_tools  # noqa: PLC0415

    return ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call,
                      json_tools.tool_call_start + "\n", "\n" + json_tools.tool_call_end)


# -- request checks -----------------------------------------------------------------


def check_schema(schema: Any, what: str, param: str) -> dict:
    """`schema` if it is a valid JSON Schema (its metaschema's check), else a BadRequest naming `param`."""
    if not isinstance(schema, dict):
        raise BadRequest(f"{what} must be a JSON Schema object", param)
    import jsonschema  # noqa: PLC0415 - the serve extra's; imported with the first schema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise BadRequest(f"{what} is not a valid JSON Schema: {e.message}", param) from None
    return schema


def check_tools(body: dict) -> tuple[list[dict] | None, Any]:
    """A chat body's `tools` and `tool_choice`, checked: (tools or None, choice).

    The choice is "auto" (default with tools), "none" (default without),
    "required", or the name of one of the tools (a named choice).
    """
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("tools must be a list of tool objects", "tools")
        for i, t in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type") != "function":
                raise BadRequest(f'{where} must be an object with "type": "function"', where)
            f = t.get("function")
            if not isinstance(f, dict):
                raise BadRequest(f"{where}.function must be an object", f"{where}.function")
            name = f.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                                 f"{where}.function.name")
            if "description" in f and f["description"] is not None and not isinstance(f["description"], str):
                raise BadRequest(f"{where}.function.description must be a string", f"{where}.function.description")
            if f.get("parameters") is not None:
                check_schema(f["parameters"], f"{where}.function.parameters", f"{where}.function.parameters")
            if "strict" in f and f["strict"] is not None and not isinstance(f["strict"], bool):
                raise BadRequest(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise BadRequest("tools name a function twice", "tools")
        tools = tools or None
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise BadRequest('tool_choice must be "auto", "none", "required" or a named function', "tool_choice")
        if choice == "required" and not tools:
            raise BadRequest('tool_choice "required" needs tools', "tool_choice")
        return tools, choice
    if (not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict)
            or not isinstance(choice["function"].get("name"), str)):
        raise BadRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                         '{"name": ...}}', "tool_choice")
    name = choice["function"]["name"]
    if not tools or name not in [t["function"]["name"] for t in tools]:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return tools, {"type": "function", "function": {"name": name}}


def forced_call_schema(tools: list[dict] | None, tool_choice: Any) -> dict | None:
    """The JSON schema a forced call (between `ToolFormat.prefix` and `suffix`) must match, or None.

    "required": one of the tools, `{"name": <const>, "arguments": <its parameters>}`;
    a named choice: that tool alone; "auto" / "none": None (nothing forced).
    """
    if not tools or tool_choice in (None, "auto", "none"):
        return None

    def one(t: dict) -> dict:
        f = t["function"]
        params = f.get("parameters") or {"type": "object"}
        return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}

    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return one(next(t for t in tools if t["function"]["name"] == name))
    options = [one(t) for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _content(m: dict, i: int) -> str | None:
    c = m.get("content")
    if isinstance(c, list):  # content parts: text only
        if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
            raise BadRequest(f"messages[{i}].content parts must be text parts", "messages")
        return "".join(x["text"] for x in c)
    if c is not None and not isinstance(c, str):
        raise BadRequest(f"messages[{i}].content must be a string", "messages")
    return c


def _tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's `tool_calls`, with arguments as objects (what chat templates render)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise BadRequest(f"{where} must be a non-empty list", "messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise BadRequest(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                             "messages")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise BadRequest(f"{where}[{j}].function.arguments is not valid JSON", "messages") from None
        if not isinstance(args, dict):
            raise BadRequest(f"{where}[{j}].function.arguments must be a JSON object", "messages")
        out.append({"id": c.get("id") or _call_id(), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """A chat body's `messages`, checked, as chat templates take them.

    Text parts are joined; an assistant message may carry `tool_calls` with
    null content (content becomes "") and its `reasoning_content`; a tool
    message keeps its `tool_call_id`.
    """
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", "messages")
        role = m["role"]
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        c = _content(m, i)
        msg: dict[str, Any] = {"role": role}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        elif c is None:
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        msg["content"] = c or ""
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str):
                raise BadRequest(f"messages[{i}].tool_call_id must be a string", "messages")
            msg["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]  # what reasoning templates render (or drop)
        clean.append(msg)
    return clean


# -- the reply ----------------------------------------------------------------------


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def openai_call(parsed: Any) -> dict | None:
    """One parsed call as OpenAI's `tool_calls` item (arguments as a JSON string).

    None unless it has a string name and arguments that are a JSON object
    (or a string holding one): what both APIs can hand a client.
    """
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    args = parsed.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": parsed.get("id") or _call_id(), "type": "function",
            "function": {"name": parsed["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolStream:
    """Splits generated text into content and tool calls, as it arrives.

    `push(text)` and `finish()` return a list of pieces: `("text", str)` or
    `("call", openai_call)`. Text that might be the start of a call marker
    is held back until it is known; a call that does not parse, or is cut off
    by the end of the reply, comes out as text (nothing is dropped).
    """

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None):
        self.fmt, self.tools = fmt, tools
        self._buf = ""
        self._in_call = False
        self.calls: list[dict] = []

    def _call(self, inner: str) -> list[tuple[str, Any]]:
        try:
            parsed = self.fmt.parse(inner, self.tools)
        except (ValueError, KeyError, TypeError, AttributeError):
            parsed = None
        out = [openai_call(p) for p in (parsed if isinstance(parsed, list) else [parsed])]
        if not out or any(c is None for c in out):
            return [("text", self.fmt.start + inner + self.fmt.end)]
        self.calls.extend(out)
        return [("call", c) for c in out]

    def push(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self._in_call:
                k = self._buf.find(self.fmt.end)
                if k < 0:
                    return out
                out += self._call(self._buf[:k])
                self._buf, self._in_call = self._buf[k + len(self.fmt.end):], False
                continue
            k = self._buf.find(self.fmt.start)
            if k >= 0:
                if k:
                    out.append(("text", self._buf[:k]))
                self._buf, self._in_call = self._buf[k + len(self.fmt.start):], True
                continue
            # Hold back a tail that could still grow into the start marker.
            hold = next((n for n in range(min(len(self.fmt.start) - 1, len(self._buf)), 0, -1)
                         if self.fmt.start.startswith(self._buf[-n:])), 0)
            cut = len(self._buf) - hold
            if cut:
                out.append(("text", self._buf[:cut]))
                self._buf = self._buf[cut:]
            return out

    def finish(self) -> list[tuple[str, Any]]:
        rest = (self.fmt.start if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return [("text", rest)] if rest else []


def split_reply(fmt: ToolFormat, tools: list[dict] | None, text: str) -> tuple[str, list[dict]]:
    """A whole reply's (content, tool calls)."""
    ts = ToolStream(fmt, tools)
    pieces = ts.push(text) + ts.finish()
    return "".join(p for k, p in pieces if k == "text"), ts.calls


__all__ = ["ROLES", "ToolFormat", "ToolStream", "chat_messages", "check_schema", "check_tools", "forced_call_schema",
           "openai_call", "split_reply", "tool_format"]
