"""OpenAI's logprobs objects from the engine's per-token entries.

The values are the raw log-softmax of the target model's logits at each
position (`mtplx_ext.decode.logprobs`): the sampler's temperature, top-k /
top-p, penalties and logit bias change which token is drawn, never its
reported logprob. Request fields: chat `logprobs: true` with `top_logprobs`
in 0..20; completions `logprobs` in 0..20 (alternatives per token).

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}, ...]}``;
* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token:
  logprob}, ...], "text_offset"}``.

A token's text is the tokenizer's decoding of that one id; its bytes are the
raw bytes it stands for (byte-level BPE vocabularies map each character of a
token back to one byte, so a token holding part of a UTF-8 character still
reports its own bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from mtplx_ext.batching.token_logprobs import Entry
from mtplx_ext.decode.logprobs import TOP_MAX
from mtplx_ext.serve.errors import BadRequest


def requested(body: dict, kind: str) -> int | None:
    """The alternatives per token a body asks for, or None for no logprobs; a 400 naming the field otherwise."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "chat":
        if lp is not None and not isinstance(lp, bool):
            raise BadRequest("logprobs must be a boolean", "logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= TOP_MAX):
            raise BadRequest(f"top_logprobs must be an integer in [0, {TOP_MAX}]", "top_logprobs")
        if not lp:
            if top is not None:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return 0 if top is None else top
    if top is not None:
        raise BadRequest("top_logprobs is a chat field; completions take logprobs: <int>", "top_logprobs")
    if lp is None:
        return None
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= TOP_MAX:
        raise BadRequest(f"logprobs must be an integer in [0, {TOP_MAX}] for completions", "logprobs")
    return lp


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte <-> printable character table, as mlx-lm's BPE detokenizer uses it.
    from mlx_lm.tokenizer_utils import _byte_decoder as table

    return table()


def _token(tokenizer: Any, tid: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([tid])
    raw = tokenizer.id_to_token(tid) if hasattr(tokenizer, "id_to_token") else None
    if raw is not None and "ByteLevel" in repr(getattr(tokenizer, "decoder", "")):
        table = _byte_decoder()
        if all(c in table for c in raw):
            return text, [table[c] for c in raw]
    return text, list(text.encode("utf-8"))


def chat(tokenizer: Any, tokens: Sequence[int], entries: Sequence[Entry]) -> dict[str, Any]:
    """The `logprobs` of a chat choice (or of one streamed delta)."""
    content = []
    for tid, (lp, alts) in zip(tokens, entries):
        text, raw = _token(tokenizer, tid)
        top = []
        for aid, alp in alts:
            atext, araw = _token(tokenizer, aid)
            top.append({"token": atext, "logprob": alp, "bytes": araw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion(tokenizer: Any, tokens: Sequence[int], entries: Sequence[Entry], offset: int = 0) -> dict[str, Any]:
    """The `logprobs` of a completion choice (or of one streamed chunk); `offset`: text before these tokens."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, (lp, alts) in zip(tokens, entries):
        text, _ = _token(tokenizer, tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        top: dict[str, float] = {}
        for aid, alp in alts:
            top.setdefault(_token(tokenizer, aid)[0], alp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def render(kind: str, tokenizer: Any, tokens: Sequence[int], entries: Sequence[Entry] | None,
           offset: int = 0) -> dict[str, Any] | None:
    """The choice's `logprobs` field: None when the request did not ask."""
    if entries is None:
        return None
    if kind == "chat":
        return chat(tokenizer, tokens, entries)
    return completion(tokenizer, tokens, entries, offset)


__all__ = ["TOP_MAX", "chat", "completion", "render", "requested"]
