"""The OpenAI Responses API: `POST /v1/responses` (streamed or not), `GET` / `DELETE /v1/responses/{id}`, and
`POST /v1/responses/input_tokens`.

A Responses body is translated into the chat route's terms
(`responses_input`: the same chat template, tool parser, grammar and
sampling arguments as `/v1/chat/completions`), decoded by the same engine,
and its reply cut into output items by `responses_output.Output` (the one
place items are assembled). Streams send OpenAI's typed events:
`response.created`, `response.in_progress`, the items' events, then
`response.completed` (`response.incomplete` when `max_output_tokens` cut
the reply; `error` and `response.failed` if the request fails), each with a
`sequence_number`. A reasoning model's thinking is split off the reply as
on the chat route (`Reply.reason`, `reasoning: {effort}` mapped as chat's
`reasoning_effort`) and comes first, as a `reasoning` item; a grammar
(`text.format`, a forced call) starts after it. With `store` (OpenAI's
default: true) the response and
its conversation are kept in the API's bounded `ResponseStore` for
`previous_response_id` and `GET`. The handlers run on the event loop and
never call MLX.
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

from mtplx_ext.batching import Event, Request
from mtplx_ext.serve import disconnect, logprobs, params, reasoning, structured, tools
from mtplx_ext.serve import responses_input as ri
from mtplx_ext.serve.errors import BadRequest, error_response
from mtplx_ext.serve.openai import Reply, engine_args, mtp_stats
from mtplx_ext.serve.responses_output import Output
from mtplx_ext.serve.responses_store import NotFound, ResponseStore


class Turn:
    """One checked request: its prompt, engine arguments, reply shape and what its response echoes.

    `conversation` is the turn's messages without `instructions` (earlier
    turns from `previous_response_id` included): what a stored response
    continues from.
    """

    def __init__(self, api: Any, body: dict, decode: bool = True):
        """`decode=False` stops once the prompt is known (`POST /v1/responses/input_tokens`)."""
        ri.check_unsupported(body)
        self.body = body
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        prev = body.get("previous_response_id")
        history = store_of(api).get(prev)[1] if prev is not None else []
        if "input" not in body:
            raise BadRequest("input is required", "input")
        self.conversation = history + ri.input_messages(body["input"])
        tool_list, choice = ri.chat_tools(body)
        self.tool_choice = body.get("tool_choice") or ("auto" if tool_list else "none")
        self.reply = Reply("chat")
        if choice != "none":  # "none": the model neither sees the tools nor calls them
            self.reply.parse_tools(tool_list, tools.tool_format(api.chat_tokenizer),
                                   body.get("parallel_tool_calls") is not False, choice)
        thinking, self.reasoning_echo = ri.reasoning_options(body)
        markers = getattr(api, "reasoning", None)  # an API stand-in may have none
        reasoning.check_model(markers, thinking)
        messages = ri.lead_system(self.conversation, body.get("instructions"))
        try:
            text = params.template_text(messages, api.chat_tokenizer, self.reply.tool_list, thinking.template_kwargs)
        except BadRequest as e:
            raise BadRequest(str(e), "input") from None  # the chat route names its messages
        self.reply.reason(markers, thinking, text, messages)
        self.prompt = api.tokenizer.encode(text).ids
        if not decode:
            return
        context = getattr(api.engine, "context", None)
        room = ri.DEFAULT_MAX_OUTPUT_TOKENS if context is None else context - len(self.prompt)
        sampling = ri.sampling(body, max(1, min(ri.DEFAULT_MAX_OUTPUT_TOKENS, room)))
        self.args = engine_args(api, body, params.submit_args(sampling, "chat", api.eos_ids))
        fmt = ri.response_format(body)
        try:
            inner = structured.constraint({"response_format": fmt} if fmt else {}, api, self.reply.tool_list,
                                          self.reply.tool_choice)
            # text.format, forced calls: after the reasoning, if any (and its budget); the grammar's stop tokens
            # join the request's
            self.args = structured.submit_args(self.args, self.reply.constraint(api, inner), inner)
        except BadRequest as e:  # the chat field's name, in the Responses body's terms
            raise BadRequest(str(e).replace("response_format.json_schema", "text.format").replace(
                "response_format", "text.format"), "text.format" if e.param == "response_format" else e.param) from None

    def response(self, api: Any, r: Request | None, output: list[dict], status: str,
                 error: dict | None = None) -> dict[str, Any]:
        """The response object (OpenAI's fields) at `status`, with `output` and, once it is not in progress, usage."""
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": api.model_name, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "previous_response_id": b.get("previous_response_id"), "reasoning": dict(self.reasoning_echo),
            "store": b.get("store") is not False, "temperature": b.get("temperature", 1.0),
            "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": self.tool_choice,
            "tools": b.get("tools") or [], "top_p": b.get("top_p", 1.0), "truncation": "disabled",
            "usage": None, "metadata": b.get("metadata") or {}, "user": b.get("user"),
        }
        if r is not None and status != "in_progress":  # the engine's last event came (`r.done` may lag it)
            thought = self.reply.reasoning_tokens(r.tokens, api.tokenizer.decode) if self.reply.reasons else 0
            out["usage"] = usage(r, thought)
            out["mtp"] = mtp_stats(r, api.engine)
        return out

    def keep(self, api: Any, response: dict[str, Any]) -> None:
        """Stores a finished response (unless `store: false`) with the conversation it continues."""
        if self.body.get("store") is not False:
            store_of(api).put(self.id, response, self.conversation + ri.input_messages(response["output"]))


def usage(r: Request, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's usage object (`cached_tokens`: prompt tokens loaded from the prefix cache;
    `reasoning_tokens`: those of the reasoning block, `Reply.reasoning_tokens`)."""
    return {"input_tokens": len(r.prompt), "input_tokens_details": {"cached_tokens": r.cached_tokens},
            "output_tokens": len(r.tokens), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": len(r.prompt) + len(r.tokens)}


def store_of(api: Any) -> ResponseStore:
    """The API's response store (made on first use, so any API-like object serves the route)."""
    store = getattr(api, "responses", None)
    if store is None:
        store = api.responses = ResponseStore()
    return store


class AnswerLogprobs:
    """The token logprobs a reply's pieces carry: the answer's only (the reasoning's tokens wrote no output_text).

    Entries are held until the reply's first answer piece (text or a call):
    then `Reply.reasoning_tokens` over the tokens so far says how many wrote
    the reasoning block; those are dropped and the rest go on, as do all
    later ones. Held entries of a reply that never got past its reasoning
    are dropped. Streams and whole responses take the same path, so their
    logprobs agree.
    """

    def __init__(self, api: Any, reply: Reply):
        self.reply, self.decode = reply, api.tokenizer.decode
        self.tokens: list[int] = []
        self.held: list[dict[str, Any]] = []
        self.cut: int | None = None if reply.reasons else 0  # the reasoning's tokens, once known

    def take(self, tokens: list[int], entries: list[dict[str, Any]] | None, pieces: list[tuple[str, Any]]
             ) -> list[dict[str, Any]] | None:
        """The entries to send with `pieces`, which `tokens` (with logprobs `entries`; None: not asked) wrote."""
        if entries is None:
            return None
        self.tokens += tokens
        self.held += entries
        if self.cut is None:
            if all(k == "reasoning" for k, _ in pieces):
                return []
            self.cut = self.reply.reasoning_tokens(self.tokens, self.decode)
            self.held = self.held[self.cut:]  # nothing was sent before the cut was known
        out, self.held = self.held, []
        return out


def _final(turn: Turn, r: Request, out: Output, lp: AnswerLogprobs) -> list[dict[str, Any]]:
    """The events that end a finished request's output (its items then complete)."""
    pieces = turn.reply.finish()
    entries = lp.take([], [] if r.logprobs is not None else None, pieces)
    return out.push(pieces, entries) + out.close(incomplete=r.finish_reason == "length")


async def create(api: Any, http: HTTPRequest) -> Response:
    """`POST /v1/responses`."""
    try:
        body = await api.body(http)
        turn = Turn(api, body)
        events: asyncio.Queue[Event] = asyncio.Queue()
        r = api.submit(turn.prompt, turn.args, disconnect.deliver(asyncio.get_running_loop(), events))
    except BadRequest as e:
        return e.response()
    if body.get("stream", False):
        return StreamingResponse(_sse(api, turn, r, events), media_type="text/event-stream")
    ev = await disconnect.finished(http.receive, events, r)
    if ev is None:
        return Response(status_code=499)  # nobody reads it
    if ev.kind == "error":
        return error_response(500, f"the request failed: {ev.error}", kind="server_error")
    out, lp = Output(turn.reply.fmt is not None), AnswerLogprobs(api, turn.reply)
    pieces = turn.reply.pieces(r.text)
    out.push(pieces, lp.take(r.tokens, _logprobs(api, r, r.tokens, r.token_logprobs), pieces))
    _final(turn, r, out, lp)
    resp = turn.response(api, r, out.items, "incomplete" if r.finish_reason == "length" else "completed")
    turn.keep(api, resp)
    return JSONResponse(resp)


def _logprobs(api: Any, r: Request, tokens: list[int], entries: list) -> list[dict[str, Any]] | None:
    """OpenAI's per-token logprobs of `tokens` (the chat route's entries), None when the request did not ask."""
    if r.logprobs is None:
        return None
    if not tokens:
        return []
    return logprobs.chat(api.tokenizer, tokens, entries)["content"]


def _sse_event(ev: dict[str, Any]) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"


async def _sse(api: Any, turn: Turn, r: Request, events: asyncio.Queue) -> AsyncIterator[str]:
    out, lp = Output(turn.reply.fmt is not None), AnswerLogprobs(api, turn.reply)
    try:
        yield _sse_event(out.event("response.created", response=turn.response(api, r, [], "in_progress")))
        yield _sse_event(out.event("response.in_progress", response=turn.response(api, r, [], "in_progress")))
        while True:
            ev = await events.get()
            if ev.kind == "tokens":
                pieces = turn.reply.pieces(ev.text) if ev.text else []
                entries = lp.take(ev.tokens, _logprobs(api, r, ev.tokens, ev.logprobs or []), pieces)
                for e in out.push(pieces, entries):
                    yield _sse_event(e)
            elif ev.kind == "done":
                for e in _final(turn, r, out, lp):
                    yield _sse_event(e)
                status = "incomplete" if r.finish_reason == "length" else "completed"
                resp = turn.response(api, r, out.items, status)
                turn.keep(api, resp)
                yield _sse_event(out.event(f"response.{status}", response=resp))
                break
            elif ev.kind == "error":
                msg = f"the request failed: {ev.error}"
                yield _sse_event(out.event("error", code="server_error", message=msg, param=None))
                err = {"code": "server_error", "message": msg}
                yield _sse_event(out.event("response.failed", response=turn.response(api, r, out.items, "failed", err)))
                break
    finally:
        if not r.done:  # the client went away mid-stream: free its row
            r.cancel()


async def input_tokens(api: Any, http: HTTPRequest) -> Response:
    """`POST /v1/responses/input_tokens`: the prompt's token count (the template with the tools), nothing decoded."""
    try:
        turn = Turn(api, await api.body(http), decode=False)
    except BadRequest as e:
        return e.response()
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(turn.prompt)})


async def retrieve(api: Any, http: HTTPRequest) -> Response:
    """`GET /v1/responses/{response_id}`: a stored response."""
    try:
        if http.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise BadRequest("streaming a stored response is not supported", "stream")
        return JSONResponse(store_of(api).get(http.path_params["response_id"], "response_id")[0])
    except BadRequest as e:
        return e.response()


async def delete(api: Any, http: HTTPRequest) -> Response:
    """`DELETE /v1/responses/{response_id}`: forgets a stored response."""
    rid = http.path_params["response_id"]
    if not store_of(api).delete(rid):
        return NotFound(rid, "response_id").response()
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


__all__ = ["AnswerLogprobs", "Turn", "create", "delete", "input_tokens", "retrieve", "store_of", "usage"]
