"""Reading a request body: the size limit, JSON parsing, and the values JSON allows but nothing downstream can use.

JSON itself admits bodies that break later code in ways a client cannot
read: nesting deep enough to exhaust Python's recursion, integers too long
for `int()`, and lone UTF-16 surrogates (`"\\ud800"`) that no tokenizer can
encode. Each is refused here with a 400 naming where in the body it sits
(`max_tokens`, `messages[0].content`), and a body over the limit is a 413
before it is read in full.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request as HTTPRequest

from mtplx_ext.serve.errors import BadRequest

#: Most digits of a JSON integer: far beyond any field's range, well under Python's int-string limit.
MAX_INT_DIGITS = 64
#: Chat roles a message may have (OpenAI's).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class _LongInt:
    """A JSON integer with more than `MAX_INT_DIGITS` digits (kept as text until the walk names its field)."""

    def __init__(self, digits: str):
        self.digits = digits


def _parse_int(text: str) -> int | _LongInt:
    return _LongInt(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


async def read(req: HTTPRequest, max_bytes: int) -> bytes:
    """The raw body, refused with a 413 once it exceeds `max_bytes` (declared or sent)."""
    declared = req.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(f"the body is {int(declared)} bytes, more than this server's limit of {max_bytes}", status=413)
    chunks, n = [], 0
    async for chunk in req.stream():
        n += len(chunk)
        if n > max_bytes:
            raise BadRequest(f"the body is more than this server's limit of {max_bytes} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def parse(raw: bytes) -> Any:
    """The body's JSON value, with every string encodable and every integer in range (else a 400 naming where)."""
    try:
        value = json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        raise BadRequest("the body nests too deeply to parse") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    _check_values(value)
    return value


def _where(path: tuple[Any, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the body"


def _check_values(value: Any) -> None:
    """Walks the parsed body without recursion (its depth is bounded only by the parser's)."""
    todo: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            _check_text(path, v)
        elif isinstance(v, _LongInt):
            raise BadRequest(f"{_where(path)} is an integer of {len(v.digits.lstrip('-'))} digits, out of range",
                             _where(path))
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_text(path + (k,), k)
                todo.append((path + (k,), x))
        elif isinstance(v, list):
            todo.extend((path + (i,), x) for i, x in enumerate(v))


def _check_text(path: tuple[Any, ...], text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _where(path)
        raise BadRequest(f"{where} holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                         "which is not text", where) from None


def check_roles(body: dict) -> None:
    """A chat body's message roles are OpenAI's (400 naming `messages[i].role`); other checks come later."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(role, str) and role not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                             f"messages[{i}].role")


__all__ = ["CHAT_ROLES", "MAX_INT_DIGITS", "check_roles", "parse", "read"]
