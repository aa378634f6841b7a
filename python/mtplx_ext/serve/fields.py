"""OpenAI request fields this server does not implement: a 400 naming the field, never a silent no-op.

Each entry maps a field to the values that mean "nothing asked" (and so are
accepted): `n: 1`, `echo: false`, ... Any other value
is refused. A field that gets implemented leaves these tables. Fields of neither table and no handler are
not OpenAI's and are left alone (clients send their own extensions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mtplx_ext.serve.errors import BadRequest


def _absent(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


def _one(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1)


#: Both routes.
COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_one, "n must be 1 (one choice per request)"),
}

#: /v1/chat/completions.
CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    **COMMON,
    "audio": (_absent, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "modalities other than [\"text\"] are not supported"),
    "prediction": (_absent, "prediction (predicted outputs) is not supported"),
    "functions": (_absent, "functions is deprecated and not supported; use tools"),
    "function_call": (_absent, "function_call is deprecated and not supported; use tool_choice"),
    "web_search_options": (_absent, "web_search_options is not supported"),
    "verbosity": (_absent, "verbosity is not supported"),
    "store": (_false, "store is not supported (nothing is stored)"),
}

#: /v1/completions.
COMPLETION: dict[str, tuple[Callable[[Any], bool], str]] = {
    **COMMON,
    "echo": (_false, "echo is not supported"),
    "best_of": (_one, "best_of must be 1"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
}

#: Chat-only fields a completion body must not carry (they would do nothing there).
CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens", "reasoning_effort",
             "enable_thinking", "chat_template_kwargs", "thinking_token_budget")


def check_unsupported(body: dict, kind: str) -> None:
    """Refuses (400 naming it) a field of `kind`'s table set to something it would have to do."""
    table = CHAT if kind == "chat" else COMPLETION
    for name, (ok, why) in table.items():
        if name in body and not ok(body[name]):
            raise BadRequest(why, name)
    if kind == "completion":
        for name in CHAT_ONLY:
            if body.get(name) is not None:
                raise BadRequest(f"{name} is a chat field; use /v1/chat/completions", name)


def include_usage(body: dict) -> bool:
    """`stream_options.include_usage`, checked (stream_options only goes with stream: true)."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    if not body.get("stream", False):
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    unknown = sorted(set(so) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise BadRequest(f"stream_options.{unknown[0]} is not supported", "stream_options")
    v = so.get("include_usage", False)
    if not isinstance(v, bool):
        raise BadRequest("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    return v


def mtp_depth(body: dict, engine_depth: int) -> int | None:
    """The extension field `mtp`: {"depth": 0..K} (0: no drafts for this request), false (0) or true (K).

    None when absent (the server's depth). `engine_depth` is K, 0 when the
    server decodes without MTP (then only 0 is allowed).
    """
    v = body.get("mtp")
    if v is None or v is True:
        return None
    if v is False:
        return 0
    if not isinstance(v, dict) or set(v) - {"depth"}:
        raise BadRequest('mtp must be {"depth": <int>}, true or false', "mtp")
    d = v.get("depth")
    if d is None:
        return None
    if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= engine_depth:
        raise BadRequest(f"mtp.depth must be an integer in [0, {engine_depth}] (this server drafts at most "
                         f"{engine_depth} tokens per cycle)", "mtp.depth")
    return d


__all__ = ["CHAT", "CHAT_ONLY", "COMMON", "COMPLETION", "check_unsupported", "include_usage", "mtp_depth"]
