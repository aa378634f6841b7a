"""OpenAI-compatible HTTP API over an `Engine` (Starlette; run it with uvicorn).

Handlers never touch MLX: they check the request, tokenize it, queue it on
the engine (whose one thread runs every MLX call) and read its events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mtplx_ext.batching import Engine, Event, Request
from mtplx_ext.sampling import SamplerConfig

#: OpenAI's defaults: completions generate 16 tokens unless told.
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class BadRequest(Exception):
    """A request the API refuses with status 400 (never reaches the engine)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    """OpenAI-style error JSON."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def _number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{name} must be a number, got {type(v).__name__}", name)
    return float(v)


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer, got {type(v).__name__}", name)
    return v


class API:
    """The routes, bound to one engine and its tokenizers.

    Args:
        engine: a started `Engine` (or one a test steps itself).
        model_name: the id `/v1/models` lists and requests must name.
        tokenizer: `tokenizers.Tokenizer`-like (encode(text).ids, decode(ids)).
        chat_tokenizer: an object with `apply_chat_template` (mlx-lm's
            tokenizer wrapper or a transformers tokenizer), or None (no chat).
        api_key: when set, /v1 routes and /metrics need `Authorization: Bearer <key>`.
        eos_ids: token ids that end every request (the tokenizer's end of text).
    """

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        tokenizer: Any,
        chat_tokenizer: Any = None,
        api_key: str | None = None,
        eos_ids: tuple[int, ...] = (),
    ):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.chat_tokenizer = chat_tokenizer
        self.api_key = api_key
        self.eos_ids = tuple(eos_ids)
        self.created = int(time.time())

    # -- request parsing ----------------------------------------------------------

    async def _body(self, req: HTTPRequest) -> dict:
        try:
            body = json.loads(await req.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"unknown model {model!r}; this server serves {self.model_name!r}", "model")
        n = _integer(body, "n")
        if n is not None and n != 1:
            raise BadRequest("n must be 1 (one choice per request)", "n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", "stream")
        return body

    def _submit_args(self, body: dict, kind: str) -> dict:
        floats = {k: _number(body, k) for k in _FLOAT_FIELDS}
        top_k = _integer(body, "top_k")
        cfg = {k: v for k, v in floats.items() if v is not None}
        if top_k is not None:
            if top_k < 0 and top_k != -1:
                raise BadRequest("top_k must be >= 0 (or -1 for off)", "top_k")
            cfg["top_k"] = max(top_k, 0)
        cfg.setdefault("temperature", 1.0)
        try:
            sampler = SamplerConfig(**cfg)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e)) from None
        max_tokens = _integer(body, "max_completion_tokens") if kind == "chat" else None
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens")
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
        seed = _integer(body, "seed")
        if seed is not None and not 0 <= seed < 2**64:
            raise BadRequest("seed must be in [0, 2**64)", "seed")
        return dict(max_tokens=max_tokens, sampler=sampler, stop=stop, seed=seed, stop_token_ids=self.eos_ids)

    def _completion_prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise BadRequest("prompt is empty", "prompt")
            return self.tokenizer.encode(p).ids
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")

    def _chat_prompt(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string role", "messages")
            c = m.get("content")
            if isinstance(c, list):  # content parts: text only
                if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                    raise BadRequest(f"messages[{i}].content parts must be text parts", "messages")
                c = "".join(x["text"] for x in c)
            if not isinstance(c, str):
                raise BadRequest(f"messages[{i}].content must be a string", "messages")
            clean.append({"role": m["role"], "content": c})
        if self.chat_tokenizer is None:
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        text = self.chat_tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text).ids

    def _submit(self, prompt: list[int], args: dict, on_event: Any) -> Request:
        try:
            return self.engine.submit(prompt, on_event=on_event, **args)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e)) from None

    # -- routes ---------------------------------------------------------------------

    async def health(self, req: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, req: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "mtplx-ext"}
        ]})

    async def metrics(self, req: HTTPRequest) -> Response:
        return JSONResponse(self.engine.metrics())

    async def completions(self, req: HTTPRequest) -> Response:
        return await self._generate(req, "completion")

    async def chat(self, req: HTTPRequest) -> Response:
        return await self._generate(req, "chat")

    async def _generate(self, http: HTTPRequest, kind: str) -> Response:
        try:
            body = await self._body(http)
            prompt = self._chat_prompt(body) if kind == "chat" else self._completion_prompt(body)
            args = self._submit_args(body, kind)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[Event] = asyncio.Queue()
            r = self._submit(prompt, args, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if body.get("stream", False):
            return StreamingResponse(self._sse(r, events, rid, kind), media_type="text/event-stream")
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
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(r), "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": r.text}
        else:
            choice["text"] = r.text
        return JSONResponse({
            "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": _usage(r), "mtp": _mtp(r, self.engine),
        })

    async def _sse(self, r: Request, events: asyncio.Queue, rid: str, kind: str) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if finish is not None:
                out["usage"] = _usage(r)
                out["mtp"] = _mtp(r, self.engine)
            return f"data: {json.dumps(out)}\n\n"

        try:
            if kind == "chat":
                yield chunk(None, None, first=True)
            while True:
                ev = await events.get()
                if ev.kind == "tokens" and ev.text:
                    yield chunk(ev.text, None)
                elif ev.kind == "done":
                    yield chunk(None, _finish(r))
                    break
                elif ev.kind == "error":
                    err = {"error": {"message": f"the request failed: {ev.error}", "type": "server_error"}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not r.done:  # the client went away mid-stream: free its row
                r.cancel()


def _finish(r: Request) -> str:
    return "length" if r.finish_reason == "length" else "stop"


def _usage(r: Request) -> dict[str, int]:
    return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens),
            "total_tokens": len(r.prompt) + len(r.tokens)}


def _mtp(r: Request, engine: Engine) -> dict[str, Any]:
    return {"depth": engine.depth if engine.mtp else 0, "cycles": r.cycles, "accepted_drafts": r.accepted,
            "acceptance": r.acceptance, "mean_accepted_length": r.mean_accepted_length}


class _Auth(BaseHTTPMiddleware):
    def __init__(self, app: Any, key: str | None):
        super().__init__(app)
        self.key = key

    async def dispatch(self, request: HTTPRequest, call_next: Any) -> Response:
        if self.key is not None and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {self.key}":
                return error_response(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                                      kind="authentication_error")
        return await call_next(request)


def create_app(api: API) -> Starlette:
    """The ASGI app: /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions."""
    routes = [
        Route("/health", api.health),
        Route("/metrics", api.metrics),
        Route("/v1/models", api.models),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
    ]
    return Starlette(routes=routes, middleware=[Middleware(_Auth, key=api.api_key)])
