"""The OpenAI routes' work: `/v1/completions` and `/v1/chat/completions`, streamed or not.

`generate` checks the body (`params`), queues the request on the engine and
turns the engine's events into OpenAI's JSON or server-sent events. It runs on
the event loop and never calls MLX; the engine's thread hands events over with
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from mtplx_ext.batching import Engine, Event, Request
from mtplx_ext.serve import logprobs, params
from mtplx_ext.serve.errors import BadRequest, error_response

async def generate(api: Any, http: HTTPRequest, kind: str) -> Response:
    """Answer one completion (`kind="completion"`) or chat request.

    `api` is the app's `API` (its engine, tokenizers, `body` and `submit`);
    it is passed in rather than imported so the handlers sit below the app.
    """
    try:
        body = await api.body(http)
        if kind == "chat":
            prompt = params.chat_prompt(body, api.tokenizer, api.chat_tokenizer)
        else:
            prompt = params.completion_prompt(body, api.tokenizer)
        args = params.submit_args(body, kind, api.eos_ids)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        r = api.submit(prompt, args, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    except BadRequest as e:
        return error_response(400, str(e), param=e.param)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    if body.get("stream", False):
        return StreamingResponse(_sse(api, r, events, rid, kind), media_type="text/event-stream")
    try:
        while True:
            ev = await events.get()
            if ev.kind in ("done", "error"):
                break
    finally:
        if not r.done:  # the client went away
            r.cancel()
    if ev.kind == "error":
        return error_response(500, f"the request failed: {ev.error}", kind="server_error")
    lp = logprobs.render(kind, api.tokenizer, r.tokens, r.token_logprobs if r.logprobs is not None else None)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(r), "logprobs": lp}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": r.text}
    else:
        choice["text"] = r.text
    return JSONResponse({
        "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()), "model": api.model_name, "choices": [choice],
        "usage": usage(r), "mtp": mtp_stats(r, api.engine),
    })


async def _sse(api: Any, r: Request, events: asyncio.Queue, rid: str, kind: str) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    # Tokens (and their logprobs) not sent yet: a chunk goes out with text.
    held: tuple[list[int], list] = ([], [])
    sent = [0]  # characters sent (completions' text_offset)

    def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
        lp = None
        if r.logprobs is not None and not first:
            lp = logprobs.render(kind, api.tokenizer, held[0], held[1], sent[0])
            held[0].clear()
            held[1].clear()
        sent[0] += len(text or "")
        if kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}
        out = {"id": rid, "object": obj, "created": created, "model": api.model_name, "choices": [choice]}
        if finish is not None:
            out["usage"] = usage(r)
            out["mtp"] = mtp_stats(r, api.engine)
        return f"data: {json.dumps(out)}\n\n"

    try:
        if kind == "chat":
            yield chunk(None, None, first=True)
        while True:
            ev = await events.get()
            if ev.kind == "tokens":
                held[0].extend(ev.tokens)
                held[1].extend(ev.logprobs or ())
            if ev.kind == "tokens" and ev.text:
                yield chunk(ev.text, None)
            elif ev.kind == "done":
                yield chunk(None, finish_reason(r))
                break
            elif ev.kind == "error":
                err = {"error": {"message": f"the request failed: {ev.error}", "type": "server_error"}}
                yield f"data: {json.dumps(err)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        if not r.done:  # the client went away mid-stream: free its row
            r.cancel()


def finish_reason(r: Request) -> str:
    """OpenAI's finish_reason of a finished request."""
    return "length" if r.finish_reason == "length" else "stop"


def usage(r: Request) -> dict[str, int]:
    """OpenAI's usage object of a request."""
    return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens),
            "total_tokens": len(r.prompt) + len(r.tokens)}


def mtp_stats(r: Request, engine: Engine) -> dict[str, Any]:
    """The extension field `mtp`: the depth served and the request's acceptance."""
    return {"depth": engine.depth if engine.mtp else 0, "cycles": r.cycles, "accepted_drafts": r.accepted,
            "acceptance": r.acceptance, "mean_accepted_length": r.mean_accepted_length}


__all__ = ["finish_reason", "generate", "mtp_stats", "usage"]
