"""Structured outputs: `response_format` (json_object, json_schema) and forced tool calls, as constraints.

`constraint(body, api, tool_list, tool_choice)` turns a request into the
grammar constraint it decodes under (`mtplx_ext.decode.constraint`; MTP stays
on), or None:

* `response_format: {"type": "text"}` or absent: no constraint;
* `{"type": "json_object"}`: any JSON object;
* `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`:
  JSON valid against `schema` (checked against its metaschema with
  jsonschema first; `strict: true` also forbids properties the schema does
  not list, as OpenAI's strict mode does, and refuses keywords the grammar
  engine does not implement, such as `uniqueItems` or `not`, with a 400
  naming them; without it they are ignored, best effort as OpenAI's
  non-strict mode);
* a `required` or named tool choice (OpenAI's `tool_choice`, Anthropic's
  `any` / `tool`), with the tools `serve.tools.check_tools` checked: the
  family's call wrapper (`ToolFormat.prefix` / `suffix`) around a JSON call
  matching `tools.forced_call_schema`, the same format the reply is parsed
  with (objects allow only the properties they list, so a call always
  closes; keywords the engine does not implement are ignored, as a tool's
  schema is the client library's, not the request's author's).

Every client mistake is a `BadRequest` naming the field. The answer ends at
the tokenizer's end-of-text token (the grammar allows it only once the JSON
is complete), or at max_tokens with finish_reason "length", as OpenAI's do.
A forced call's grammar ends with the call's closing marker: only the stop
token may follow, so the request ends when the call closes (finish_reason
"tool_calls", Anthropic's stop_reason "tool_use"); `submit_args` makes the
grammar's stop tokens the request's too.

The grammar engine is llguidance (the `serve` extra; no torch or triton).
Without it a structured request gets a 400 naming the field and the extra to
install, and `capability()` is the line the server logs at startup. The
grammar vocabulary (llguidance's tokenizer) is built once per API, at the
first constrained request.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from mtplx_ext.decode.constraint import GrammarVocab, grammar_engine
from mtplx_ext.serve import tools
from mtplx_ext.serve.errors import BadRequest

#: What a server without the grammar engine tells a client that asked for structured output.
INSTALL = "pip install 'mtplx-ext[serve]'"

_lock = threading.Lock()
#: Each served API's grammar vocabulary, built at its first structured request (seconds for a large vocabulary).
_vocabs: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def capability() -> str:
    """One line on whether this server can decode structured outputs (the serve log's startup line)."""
    version = grammar_engine()
    if version is None:
        return (f"structured outputs off: response_format and forced tool calls get a 400 "
                f"(the grammar engine llguidance is not installed: {INSTALL})")
    return f"structured outputs on (llguidance {version}): response_format json_object / json_schema, forced tool calls"


def grammar_vocab(api: Any, param: str = "response_format") -> Any:
    """The API's `GrammarVocab` (built on first use); a BadRequest naming `param` without the grammar engine."""
    if grammar_engine() is None:
        raise BadRequest(f"{param} needs structured outputs, which this server cannot decode: the grammar engine "
                         f"(llguidance) is not installed; install it with {INSTALL}", param)
    gv = _vocabs.get(api)
    if gv is None:
        with _lock:
            gv = _vocabs.get(api)
            if gv is None:
                gv = GrammarVocab(api.tokenizer, api.engine.vocab, list(api.eos_ids) or None)
                _vocabs[api] = gv
    return gv


def response_format_constraint(body: dict, api: Any) -> Any:
    """The constraint of the body's `response_format`, or None."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise BadRequest("response_format must be an object with a type", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar_vocab(api).json_object()
    if kind != "json_schema":
        raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                         "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise BadRequest("response_format.json_schema must be an object with name and schema", "response_format")
    name = js.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("response_format.json_schema.name must be a non-empty string", "response_format")
    strict = js.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest("response_format.json_schema.strict must be a boolean", "response_format")
    schema = tools.check_schema(js.get("schema", {"type": "object"}), "response_format.json_schema.schema",
                                "response_format")
    try:
        return grammar_vocab(api).json_schema(schema, strict=bool(strict))
    except ValueError as e:
        raise BadRequest(f"response_format.json_schema.schema: {e}", "response_format") from None


def tool_call_constraint(tool_list: list[dict] | None, tool_choice: Any, api: Any) -> Any:
    """The constraint of a forced call (checked tools and choice, `tools.check_tools`), or None.

    The call grammar is the family's `ToolFormat.prefix`, a JSON call matching
    `tools.forced_call_schema`, then its `suffix`: what the reply's tool
    parser reads back.
    """
    schema = tools.forced_call_schema(tool_list, tool_choice)
    if schema is None:
        return None
    fmt = tools.tool_format(getattr(api, "chat_tokenizer", None))
    try:
        return grammar_vocab(api, "tool_choice").wrapped_json(fmt.prefix, schema, fmt.suffix, strict=True, lenient=True)
    except ValueError as e:
        raise BadRequest(f"tools: cannot build the call grammar: {e}", "tools") from None


def submit_args(args: dict, constraint: Any, grammar: Any = None) -> dict:
    """`args` (`Engine.submit`'s) with `constraint`, whose grammar's stop tokens join the request's stop tokens.

    `grammar` is the grammar inside `constraint` where something wraps it
    (the reasoning phase in front of it); by default `constraint` itself.
    The grammar allows only its stop tokens once it is complete (a forced
    call's closing marker written), so the request ends right there; a stop
    token the request did not list would let it run on to max_tokens.
    """
    grammar = constraint if grammar is None else grammar
    out = {**args, "constraint": constraint}
    stops = tuple(args.get("stop_token_ids") or ())
    more = tuple(t for t in getattr(grammar, "stop_token_ids", ()) if t not in stops)
    if more:
        out["stop_token_ids"] = stops + more
    return out


def constraint(body: dict, api: Any, tool_list: list[dict] | None = None, tool_choice: Any = "none") -> Any:
    """The request's constraint: a forced tool call, else its response_format, else None."""
    forced = tool_call_constraint(tool_list, tool_choice, api)
    if forced is not None:
        if body.get("response_format") not in (None, {"type": "text"}):
            raise BadRequest("response_format cannot be combined with a forced tool call", "response_format")
        return forced
    return response_format_constraint(body, api)


__all__ = ["INSTALL", "capability", "constraint", "grammar_vocab", "response_format_constraint", "submit_args",
           "tool_call_constraint"]
