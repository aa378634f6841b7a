"""Structured outputs: `response_format` (json_object, json_schema) and forced tool calls, as constraints.

`constraint(body, api)` turns a chat or completion body into the grammar
constraint its request decodes under (`mtplx_ext.engine.constraint`; MTP
stays on), or None:

* `response_format: {"type": "text"}` or absent: no constraint;
* `{"type": "json_object"}`: any JSON object;
* `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`:
  JSON valid against `schema` (checked against its metaschema with
  jsonschema first; `strict: true` also forbids properties the schema does
  not list, as OpenAI's strict mode does);
* `tool_choice` `"required"` or `{"type": "function", "function": {"name"}}`
  with `tools`: the tool-call wrapper's prefix, a JSON call
  `{"name": ..., "arguments": {...}}` of one of the allowed tools
  (`forced_call_schema`), then the wrapper's suffix.

Every client mistake is a `BadRequest` naming the field (`response_format`,
`tools`, `tool_choice`). The answer ends at the tokenizer's end-of-text
token (the grammar allows it only once the JSON is complete), or at
max_tokens with finish_reason "length", as OpenAI's do. The grammar vocabulary
(xgrammar's tokenizer info and compiler) is built once per API, at the first
constrained request.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from mtplx_ext.serve.errors import BadRequest

#: The tool-call wrapper when the tokenizer does not name one (the Hermes /
#: Qwen format that mlx-lm's default tool parser reads).
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>\n", "\n</tool_call>"

_lock = threading.Lock()


def grammar_vocab(api: Any) -> Any:
    """The API's `GrammarVocab` (built on first use)."""
    gv = getattr(api, "_grammar_vocab", None)
    if gv is None:
        with _lock:
            gv = getattr(api, "_grammar_vocab", None)
            if gv is None:
                try:
                    from mtplx_ext.engine.constraint import GrammarVocab
                except ImportError as e:  # pragma: no cover - the serve extra installs it
                    raise BadRequest(f"structured outputs need xgrammar (pip install 'mtplx-ext[serve]'): {e}",
                                     "response_format") from None
                gv = GrammarVocab(api.tokenizer, api.engine.vocab, list(api.eos_ids) or None)
                api._grammar_vocab = gv
    return gv


def _check_schema(schema: Any, field: str) -> dict:
    if not isinstance(schema, dict):
        raise BadRequest(f"{field} must be a JSON Schema object", "response_format")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise BadRequest(f"{field} is not a valid JSON Schema: {e.message}", "response_format") from None
    return schema


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
    schema = _check_schema(js.get("schema", {"type": "object"}), "response_format.json_schema.schema")
    try:
        return grammar_vocab(api).json_schema(schema, strict=bool(strict))
    except ValueError as e:
        raise BadRequest(f"response_format.json_schema.schema: {e}", "response_format") from None


def _tool_functions(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise BadRequest("tools must be a non-empty list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        out.append(f)
    return out


def forced_call_schema(tools: Any, tool_choice: Any) -> dict | None:
    """The JSON schema of the call a `tool_choice` forces (None for "auto" / "none" / absent).

    A call is `{"name": <tool name>, "arguments": <its parameters>}`; with
    "required" any of the tools, with a named function that one.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    fns = _tool_functions(tools)
    if tool_choice == "required":
        allowed = fns
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        allowed = [f for f in fns if f["name"] == name]
        if not allowed:
            raise BadRequest(f"tool_choice names {name!r}, which is not among tools", "tool_choice")
    else:
        raise BadRequest("tool_choice must be auto, none, required or {'type': 'function', 'function': {'name'}}",
                         "tool_choice")
    calls = []
    for f in allowed:
        params = f.get("parameters", {"type": "object"})
        _check_schema(params, f"tools function {f['name']!r} parameters")
        calls.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_call_constraint(body: dict, api: Any) -> Any:
    """The constraint of a forced tool call (wrapper prefix + call JSON + suffix), or None."""
    schema = forced_call_schema(body.get("tools"), body.get("tool_choice"))
    if schema is None:
        return None
    import xgrammar as xgr

    tok = getattr(api, "chat_tokenizer", None)
    start = getattr(tok, "tool_call_start", None) or TOOL_CALL_START
    end = getattr(tok, "tool_call_end", None) or TOOL_CALL_END
    try:
        call = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(start)}"), call,
                                     xgr.Grammar.from_ebnf(f"root ::= {json.dumps(end)}"))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for schemas it cannot compile
        raise BadRequest(f"tools: cannot build the call grammar: {e}", "tools") from None
    from mtplx_ext.engine.constraint import GrammarConstraint

    gv = grammar_vocab(api)
    return GrammarConstraint(gv.compiler.compile_grammar(grammar), encode=gv.encode)


def constraint(body: dict, api: Any) -> Any:
    """The request's constraint: a forced tool call, else its response_format, else None."""
    forced = tool_call_constraint(body, api)
    if forced is not None:
        if body.get("response_format") not in (None, {"type": "text"}):
            raise BadRequest("response_format cannot be combined with a forced tool call", "response_format")
        return forced
    return response_format_constraint(body, api)


__all__ = ["TOOL_CALL_END", "TOOL_CALL_START", "constraint", "forced_call_schema", "grammar_vocab",
           "response_format_constraint", "tool_call_constraint"]
