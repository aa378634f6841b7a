"""Request fields -> engine arguments: the sampler, token budget, stops, seed and the prompt.

Each check names the request field it refuses (`BadRequest.param`), so a
client sees which of its fields is wrong; nothing here touches MLX.
"""

from __future__ import annotations

import re
from typing import Any

from mtplx_ext.sampling import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, SamplerConfig
from mtplx_ext.serve import logprobs, tools
from mtplx_ext.serve.errors import BadRequest

#: OpenAI's defaults: completions generate 16 tokens unless told.
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def number(body: dict, name: str) -> float | None:
    """`body[name]` as a float, None when absent; a 400 naming `name` when it is not a number."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{name} must be a number, got {type(v).__name__}", name)
    return float(v)


def integer(body: dict, name: str) -> int | None:
    """`body[name]` as an int, None when absent; a 400 naming `name` when it is not an integer."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer, got {type(v).__name__}", name)
    return v


def logit_bias(body: dict) -> dict[int, float]:
    """`body["logit_bias"]` ({"token id": bias in [-100, 100]}, OpenAI's form) as {id: bias}; a 400 naming it otherwise.

    Ids past the model's vocabulary are refused by the engine at submit (a
    400 whose message names `logit_bias`).
    """
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRequest("logit_bias must be an object mapping token ids (strings) to numbers in [-100, 100]",
                         "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(v)}", "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 and int(k) < 2**31):
            raise BadRequest(f"logit_bias keys must be token ids (decimal strings), got {k!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise BadRequest(f"logit_bias[{k!r}] must be a number in [-100, 100], got {b!r}", "logit_bias")
        out[int(k)] = float(b)
    return out


def submit_args(body: dict, kind: str, eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """The keyword arguments of `Engine.submit` for a completion (`kind="completion"`) or chat body."""
    floats = {k: number(body, k) for k in FLOAT_FIELDS}
    top_k = integer(body, "top_k")
    cfg = {k: v for k, v in floats.items() if v is not None}
    if top_k is not None:
        if top_k < 0 and top_k != -1:
            raise BadRequest("top_k must be >= 0 (or -1 for off)", "top_k")
        cfg["top_k"] = max(top_k, 0)
    cfg.setdefault("temperature", 1.0)
    bias = logit_bias(body)
    if bias:
        cfg["logit_bias"] = bias
    try:
        sampler = SamplerConfig(**cfg)
    except (ValueError, TypeError) as e:  # "SamplerConfig.<field> must ...": name the request's field
        field = re.match(r"SamplerConfig\.(\w+)", str(e))
        raise BadRequest(str(e).replace("SamplerConfig.", ""), field and field.group(1)) from None
    max_tokens = integer(body, "max_completion_tokens") if kind == "chat" else None
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS[kind]
    if max_tokens < 1:
        raise BadRequest("max_tokens must be >= 1", "max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("stop must be a non-empty string or a list of up to 4 of them", "stop")
    seed = integer(body, "seed")
    if seed is not None and not 0 <= seed < 2**64:
        raise BadRequest("seed must be in [0, 2**64)", "seed")
    return dict(max_tokens=max_tokens, sampler=sampler, stop=stop, seed=seed, stop_token_ids=eos_ids,
                logprobs=logprobs.requested(body, kind))


def completion_prompt(body: dict, tokenizer: Any) -> list[int]:
    """The token ids of a completion body's `prompt` (a string, a one-string list, or token ids)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise BadRequest("prompt is empty", "prompt")
        return tokenizer.encode(p).ids
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """A chat body's `messages`, checked (`tools.chat_messages`: text parts joined, tool loops kept)."""
    return tools.chat_messages(body)


def chat_prompt(body: dict, tokenizer: Any, chat_tokenizer: Any, tool_list: list[dict] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The token ids of a chat body: its messages (and `tool_list`, the checked tools) through the chat template."""
    clean = chat_messages(body)
    return template_prompt(clean, tokenizer, chat_tokenizer, tool_list, template_kwargs)


def template_text(messages: list[dict], chat_tokenizer: Any, tool_list: list[dict] | None,
                  template_kwargs: dict[str, Any] | None = None) -> str:
    """Checked chat messages (OpenAI's shape) and tools through the model's chat template, as text.

    `template_kwargs` (a request's `chat_template_kwargs`, `enable_thinking`, ...)
    reach the template as its variables.
    """
    if chat_tokenizer is None:
        raise BadRequest("this model has no chat template; use /v1/completions", "messages")
    kw = {"tools": tool_list} if tool_list else {}
    try:
        return chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **(template_kwargs or {}), **kw)
    except Exception as e:  # noqa: BLE001 - a template that refuses these messages (jinja raise_exception)
        raise BadRequest(f"the chat template refused the messages: {e}", "messages") from None


def template_prompt(messages: list[dict], tokenizer: Any, chat_tokenizer: Any, tool_list: list[dict] | None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """`template_text`, tokenized."""
    return tokenizer.encode(template_text(messages, chat_tokenizer, tool_list, template_kwargs)).ids


__all__ = ["DEFAULT_MAX_TOKENS", "FLOAT_FIELDS", "chat_messages", "chat_prompt", "completion_prompt", "integer",
           "logit_bias", "number", "submit_args", "template_prompt",
           "template_text"]
