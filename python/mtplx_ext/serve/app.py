"""The HTTP app over an `Engine` (Starlette; run it with uvicorn): routes, auth, shared checks.

Handlers never touch MLX: they check the request, tokenize it, queue it on
the engine (whose one thread runs every MLX call) and read its events.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mtplx_ext.batching import Engine, Request
from mtplx_ext.serve import anthropic, openai, responses
from mtplx_ext.serve import body as bodies
from mtplx_ext.serve import limits, reasoning
from mtplx_ext.serve.errors import BadRequest, anthropic_error, error_response
from mtplx_ext.serve.metrics import ResponseCounter, ServeMetrics
from mtplx_ext.serve.params import integer
from mtplx_ext.serve.responses_store import ResponseStore


class API:
    """The routes, bound to one engine and its tokenizers.

    Args:
        engine: a started `Engine` (or one a test steps itself).
        model_name: the id `/v1/models` lists and requests must name.
        tokenizer: `tokenizers.Tokenizer`-like (encode(text).ids, decode(ids)).
        chat_tokenizer: an object with `apply_chat_template` (mlx-lm's
            tokenizer wrapper or a transformers tokenizer), or None (no chat).
        api_key: when set, /v1 routes and /metrics (.json) need `Authorization: Bearer <key>`
            (the scheme's case does not matter).
        eos_ids: token ids that end every request (the tokenizer's end of text).
        max_body_bytes: larger request bodies get a 413.
        reasoning_markers: "auto" (found from the tokenizer and the chat
            template), "none" (the model does not reason) or "START,END"
            (`serve.reasoning.detect`); the result is `reasoning`.
    """

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        tokenizer: Any,
        chat_tokenizer: Any = None,
        api_key: str | None = None,
        eos_ids: tuple[int, ...] = (),
        max_body_bytes: int = limits.DEFAULT_MAX_BODY_BYTES,
        reasoning_markers: Any = "auto",
    ):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.chat_tokenizer = chat_tokenizer
        self.api_key = api_key
        self.eos_ids = tuple(eos_ids)
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.reasoning = reasoning.detect(chat_tokenizer, tokenizer, reasoning_markers)
        #: Stored responses of /v1/responses (`store`, `previous_response_id`), bounded.
        self.responses = ResponseStore()
        self.prometheus = ServeMetrics(engine)  # its own registry (`serve.metrics`)

    # -- request parsing ----------------------------------------------------------

    async def body(self, req: HTTPRequest) -> dict:
        """The request's JSON object, checked for the fields every route shares (`body` module: size, values)."""
        body = bodies.parse(await bodies.read(req, self.max_body_bytes))
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        bodies.check_roles(body)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"unknown model {model!r}; this server serves {self.model_name!r}", "model")
        n = integer(body, "n")
        if n is not None and n != 1:
            raise BadRequest("n must be 1 (one choice per request)", "n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", "stream")
        return body

    def submit(self, prompt: list[int], args: dict, on_event: Any) -> Request:
        """Queue a checked request on the engine; what the engine refuses is a 400 (in the request's terms)."""
        watch = self.prometheus.watch(len(prompt), on_event)
        try:
            r = self.engine.submit(prompt, on_event=watch, **args)
        except (ValueError, TypeError) as e:
            msg = str(e)
            if msg.startswith("prompts[0]"):  # the engine's one-prompt list: the request's prompt ids
                raise BadRequest("prompt" + msg[len("prompts[0]"):], "prompt") from None
            raise BadRequest(msg) from None
        watch.queued()
        return r

    # -- routes ---------------------------------------------------------------------

    async def health(self, req: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok"})

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "mtplx-ext"}

    async def models(self, req: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, req: HTTPRequest) -> Response:
        mid = req.path_params["model_id"]
        if mid != self.model_name:
            return error_response(404, f"unknown model {mid!r}; this server serves {self.model_name!r}",
                                  param="model", code="model_not_found")
        return JSONResponse(self.model_card())

    async def metrics(self, req: HTTPRequest) -> Response:
        """The Prometheus exposition of this API's registry (`serve.metrics`)."""
        body, content_type = self.prometheus.render(req.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    async def metrics_json(self, req: HTTPRequest) -> Response:
        """`Engine.metrics()` as JSON (`/metrics` is the Prometheus text of `serve.metrics`)."""
        return JSONResponse(self.engine.metrics())

    async def completions(self, req: HTTPRequest) -> Response:
        return await openai.generate(self, req, "completion")

    async def chat(self, req: HTTPRequest) -> Response:
        return await openai.generate(self, req, "chat")

    async def messages(self, req: HTTPRequest) -> Response:
        return await anthropic.messages(self, req)

    async def count_tokens(self, req: HTTPRequest) -> Response:
        return await anthropic.count_tokens(self, req)

    async def responses_create(self, req: HTTPRequest) -> Response:
        return await responses.create(self, req)

    async def responses_input_tokens(self, req: HTTPRequest) -> Response:
        return await responses.input_tokens(self, req)

    async def responses_item(self, req: HTTPRequest) -> Response:
        if req.method == "DELETE":
            return await responses.delete(self, req)
        return await responses.retrieve(self, req)


def _anthropic_path(path: str) -> bool:
    """Routes whose clients read Anthropic's error JSON."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


async def _http_error(request: HTTPRequest, exc: Exception) -> Response:
    """404 / 405 / any HTTPException as JSON (Anthropic's shape under /v1/messages)."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    if status == 404:
        detail = f"no route {request.url.path}"
    elif status == 405:
        detail = f"method {request.method} is not allowed on {request.url.path}"
    if _anthropic_path(request.url.path):
        resp = anthropic_error(status, detail)
    else:
        resp = error_response(status, detail, kind="not_found_error" if status == 404 else "invalid_request_error")
    for k, v in (getattr(exc, "headers", None) or {}).items():  # Allow on a 405
        resp.headers[k] = v
    return resp


def authorized(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries `key` under the Bearer scheme (any case, RFC 7235)."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class _Auth:
    """The API key check, as plain ASGI so the handlers still see the client's own disconnect message."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key is not None and scope["path"] != "/health":
            headers = Headers(scope=scope)
            # OpenAI clients send a bearer token, Anthropic clients x-api-key: either will do.
            api_key = headers.get("x-api-key")
            if not (authorized(headers.get("authorization"), self.key)
                    or (api_key is not None and hmac.compare_digest(api_key.encode(), self.key.encode()))):
                why = "missing or wrong API key (send Authorization: Bearer <key> or x-api-key: <key>)"
                if _anthropic_path(scope["path"]):
                    response = anthropic_error(401, why)
                else:
                    response = error_response(401, why, kind="authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(api: API) -> Starlette:
    """The ASGI app: /health, /metrics (Prometheus), /metrics.json, /v1/models[/{id}], /v1/completions,
    /v1/chat/completions, /v1/messages, /v1/responses (and /{id}, /input_tokens).

    Every error, an unknown route (404) or method (405) included, is JSON.
    """
    routes = [
        Route("/health", api.health),
        Route("/metrics", api.metrics),
        Route("/metrics.json", api.metrics_json),
        Route("/v1/models", api.models),
        Route("/v1/models/{model_id:path}", api.model),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
        Route("/v1/responses", api.responses_create, methods=["POST"]),
        Route("/v1/responses/input_tokens", api.responses_input_tokens, methods=["POST"]),
        Route("/v1/responses/{response_id}", api.responses_item, methods=["GET", "DELETE"]),
    ]
    middleware = [Middleware(ResponseCounter, counter=api.prometheus.responses, routes=routes),
                  Middleware(_Auth, key=api.api_key)]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: _http_error})
