"""The OpenAI routes' work: `/v1/completions` and `/v1/chat/completions`, streamed or not.

`generate` checks the body (`parse_request`: `params`, `fields`, `tools`),
queues the request on the engine and turns the engine's events into OpenAI's
JSON or server-sent events; `choice_json` builds every choice and delta, and
`Reply` cuts tool calls out of the text. It runs on
the event loop and never calls MLX; the engine's thread hands events over with
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from mtplx_ext.batching import Engine, Event, Request
from mtplx_ext.serve import disconnect, fields, logprobs, params, reasoning, structured, tools
from mtplx_ext.serve.errors import BadRequest, error_response


@dataclass
class Reply:
    """What one request asked of its reply's shape: the route, tool parsing, usage in streams.

    `pieces(text)` / `finish()` turn newly final text into ("reasoning", str),
    ("text", str) and ("call", tool call) pieces: the reasoning is split off
    first (`reason`), tool calls are cut from the answer only; without
    either every piece is text.
    """

    kind: str
    tool_list: list[dict] | None = None
    fmt: Any = None  # tools.ToolFormat when tool calls are parsed
    parallel: bool = True
    include_usage: bool = False
    #: "auto", "required" or a named choice when tools are parsed (see `tools.forced_call_schema`).
    tool_choice: Any = "none"

    def __post_init__(self) -> None:
        self._split: tools.ToolStream | None = None
        self._think: reasoning.ReasoningSplitter | None = None
        self.n_calls = 0
        #: The model's reasoning markers (None: it does not reason), what the request asked of the
        #: reasoning, and whether the prompt opened it (`reason`).
        self.markers: reasoning.Markers | None = None
        self.thinking = reasoning.Thinking()
        self.in_reasoning = False

    def reason(self, markers: reasoning.Markers | None, thinking: reasoning.Thinking, prompt_text: str,
               messages: list[dict]) -> None:
        """Split the model's reasoning off the reply (`markers` None: nothing to split).

        `prompt_text` is `messages` through the template: whether its
        generation prompt opened the reasoning (`reasoning.opens_reasoning`).
        """
        self.markers, self.thinking = markers, thinking
        last = messages[-1].get("content") if messages else None
        self.in_reasoning = reasoning.opens_reasoning(prompt_text, markers, last if isinstance(last, str) else "")
        self._think = reasoning.ReasoningSplitter(markers, self.in_reasoning) if markers is not None else None

    @property
    def reasons(self) -> bool:
        """The reply is split into reasoning and answer (the model has markers)."""
        return self._think is not None

    def constraint(self, api: Any, inner: Any) -> Any:
        """The request's constraint: `inner` (its grammar, or None) behind the reasoning phase and its budget."""
        return reasoning.gate(api, self.markers, inner, self.thinking, self.in_reasoning)

    def reasoning_tokens(self, tokens: list[int], decode: Callable[[list[int]], str]) -> int:
        """How many of the reply's `tokens` wrote its reasoning block (markers included), as the splitter cuts it.

        `decode(ids) -> str` is the tokenizer's. The block runs from the
        reply's start (or the start marker that opens it) to the token that
        completes the first end marker; a reply cut inside it is all
        reasoning, one without a block has none. Each end-marker check
        decodes a short window of tokens, so a marker spelled across tokens
        (or a character cut across them) is found and the count stays linear.
        """
        m = self.markers
        if m is None or not tokens:
            return 0
        first = 0
        if not self.in_reasoning:  # only the reply's start (after whitespace) may open the block
            for i in range(len(tokens)):
                lead = decode(tokens[:i + 1]).lstrip()
                if lead.startswith(m.start):
                    first = i
                    break
                if not m.start.startswith(lead):
                    return 0
            else:
                return 0
        window = 16 + len(m.end.encode())  # tokens: more than any marker's bytes take
        for k in range(first, len(tokens)):
            if m.end in decode(tokens[max(first, k + 1 - window):k + 1]):
                return k + 1
        return len(tokens)

    def parse_tools(self, tool_list: list[dict] | None, fmt: Any, parallel: bool = True, choice: Any = "auto") -> None:
        """Cut calls in `fmt` out of the reply (`parallel=False`: keep the first call only).

        A `required` or named `choice` is what a grammar would force:
        `tools.forced_call_schema(self.tool_list, self.tool_choice)` between
        `fmt.prefix` and `fmt.suffix`; without one the reply runs unconstrained.
        """
        self.tool_list, self.fmt, self.parallel, self.tool_choice = tool_list, fmt, parallel, choice
        self._split = tools.ToolStream(fmt, tool_list)

    def pieces(self, text: str) -> list[tuple[str, Any]]:
        if self._think is None:
            return self._answer(text)
        return self._after_reasoning(self._think.push(text), last=False)

    def finish(self) -> list[tuple[str, Any]]:
        if self._think is None:
            return self._answer(None)
        return self._after_reasoning(self._think.finish(), last=True)

    def _after_reasoning(self, pieces: list[tuple[str, str]], last: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for k, p in pieces:
            out += [(k, p)] if k == "reasoning" else self._answer(p)
        return out + (self._answer(None) if last else [])

    def _answer(self, text: str | None) -> list[tuple[str, Any]]:
        """Answer text through the tool-call cutter (None: the reply's end)."""
        if self._split is None:
            return [("text", text)] if text else []
        return self._keep(self._split.push(text) if text is not None else self._split.finish())

    def _keep(self, pieces: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out = []
        for k, p in pieces:
            if k == "call":
                if self.n_calls and not self.parallel:
                    continue  # parallel_tool_calls: false keeps the first call
                self.n_calls += 1
            out.append((k, p))
        return out


def parse_request(api: Any, body: dict, kind: str) -> tuple[list[int], dict[str, Any], Reply]:
    """A checked body's prompt, engine arguments and reply shape (400s name the field)."""
    fields.check_unsupported(body, kind)
    reply = Reply(kind, include_usage=fields.include_usage(body))
    if kind == "chat":
        tool_list, choice = tools.check_tools(body)
        parallel = body.get("parallel_tool_calls")
        parallel = True if parallel is None else parallel
        if not isinstance(parallel, bool):
            raise BadRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
        if choice != "none":  # "none": the model neither sees the tools nor calls them
            reply.parse_tools(tool_list, tools.tool_format(api.chat_tokenizer), parallel, choice)
        thinking = reasoning.openai_options(body)
        markers = getattr(api, "reasoning", None)  # an API stand-in may have none
        reasoning.check_model(markers, thinking)
        messages = params.chat_messages(body)
        text = params.template_text(messages, api.chat_tokenizer, reply.tool_list, thinking.template_kwargs)
        reply.reason(markers, thinking, text, messages)
        prompt = api.tokenizer.encode(text).ids
    else:
        prompt = params.completion_prompt(body, api.tokenizer)
    return prompt, engine_args(api, body, params.submit_args(body, kind, api.eos_ids)), reply


def engine_args(api: Any, body: dict, args: dict[str, Any]) -> dict[str, Any]:
    """`args` plus the extension fields that reach the engine (`mtp`: this request's depth)."""
    depth = fields.mtp_depth(body, api.engine.depth if api.engine.mtp else 0)
    return args if depth is None else {**args, "depth": depth}


async def generate(api: Any, http: HTTPRequest, kind: str) -> Response:
    """Answer one completion (`kind="completion"`) or chat request.

    `api` is the app's `API` (its engine, tokenizers, `body` and `submit`);
    it is passed in rather than imported so the handlers sit below the app.
    """
    try:
        body = await api.body(http)
        prompt, args, reply = parse_request(api, body, kind)
        # response_format, forced tool calls: after the reasoning, if any (and its budget)
        grammar = structured.constraint(body, api, reply.tool_list, reply.tool_choice)
        args = structured.submit_args(args, reply.constraint(api, grammar), grammar)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        r = api.submit(prompt, args, disconnect.deliver(loop, events))
    except BadRequest as e:
        return e.response()
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    if body.get("stream", False):
        return StreamingResponse(_sse(api, r, events, rid, reply), media_type="text/event-stream")
    ev = await disconnect.finished(http.receive, events, r)
    if ev is None:
        return Response(status_code=499)  # nobody reads it
    if ev.kind == "error":
        return error_response(500, f"the request failed: {ev.error}", kind="server_error")
    pieces = reply.pieces(r.text) + reply.finish()
    text = "".join(p for k, p in pieces if k == "text")
    calls = [p for k, p in pieces if k == "call"]
    thought = "".join(p for k, p in pieces if k == "reasoning") if reply.reasons else None
    lp = logprobs.render(kind, api.tokenizer, r.tokens, r.token_logprobs if r.logprobs is not None else None)
    return JSONResponse({
        "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()), "model": api.model_name,
        "choices": [choice_json(kind, finish_reason(r, bool(calls)), text=text, tool_calls=calls, logprobs=lp,
                                reasoning=thought)],
        "usage": reply_usage(api, r, reply), "mtp": mtp_stats(r, api.engine),
    })


def choice_json(kind: str, finish: str | None, *, text: str | None = None, tool_calls: list[dict] | None = None,
                stream: bool = False, first: bool = False, logprobs: dict[str, Any] | None = None,
                reasoning: str | None = None) -> dict[str, Any]:
    """One choice of a response (`stream=False`) or of a stream chunk: the one place a choice is built.

    A chat message with tool calls and no other text has null content, as
    OpenAI's; a stream's first chat chunk carries the role. `reasoning` is
    the model's reasoning (vLLM's `reasoning_content`): on a message of a
    model that reasons (null when it did not this time), on a delta when
    there is some.
    """
    choice: dict[str, Any] = {"index": 0}
    if kind == "chat":
        if stream:
            msg: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if reasoning:
                msg["reasoning_content"] = reasoning
            if text:
                msg["content"] = text
        else:
            msg = {"role": "assistant", "content": None if tool_calls and not text.strip() else text}
            if reasoning is not None:
                msg["reasoning_content"] = reasoning or None
        if tool_calls:
            msg["tool_calls"] = tool_calls
        choice["delta" if stream else "message"] = msg
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish
    return choice


async def _sse(api: Any, r: Request, events: asyncio.Queue, rid: str, reply: Reply) -> AsyncIterator[str]:
    created = int(time.time())
    kind = reply.kind
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(choices: list[dict], extra: dict | None = None) -> str:
        out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": api.model_name,
                               "choices": choices}
        if reply.include_usage:
            out["usage"] = None
        out.update(extra or {})
        return f"data: {json.dumps(out)}\n\n"

    # Tokens (and their logprobs) not sent yet: they go out with the next text.
    held: tuple[list[int], list] = ([], [])
    offset = 0  # characters sent (completions' text_offset)

    def take_logprobs(text: str) -> dict[str, Any] | None:
        nonlocal offset
        lp = None
        if r.logprobs is not None and held[0]:
            lp = logprobs.render(kind, api.tokenizer, held[0], held[1], offset)
            held[0].clear()
            held[1].clear()
        offset += len(text)
        return lp

    sent = 0  # tool calls streamed so far: the next one's index

    def piece_chunks(pieces: list[tuple[str, Any]]) -> Iterator[str]:
        nonlocal sent
        for k, p in pieces:
            if k == "reasoning":
                yield chunk([choice_json(kind, None, reasoning=p, stream=True, logprobs=take_logprobs(""))])
                continue
            if k == "text":
                if p:
                    yield chunk([choice_json(kind, None, text=p, stream=True, logprobs=take_logprobs(p))])
                continue
            i, sent = sent, sent + 1
            head = {"index": i, "id": p["id"], "type": "function",
                    "function": {"name": p["function"]["name"], "arguments": ""}}
            yield chunk([choice_json(kind, None, tool_calls=[head], stream=True)])
            args = {"index": i, "function": {"arguments": p["function"]["arguments"]}}
            yield chunk([choice_json(kind, None, tool_calls=[args], stream=True)])

    try:
        if kind == "chat":
            yield chunk([choice_json(kind, None, stream=True, first=True)])
        while True:
            ev = await events.get()
            if ev.kind == "tokens":
                held[0].extend(ev.tokens)
                held[1].extend(ev.logprobs or ())
            if ev.kind == "tokens" and ev.text:
                for c in piece_chunks(reply.pieces(ev.text)):
                    yield c
            elif ev.kind == "done":
                for c in piece_chunks(reply.finish()):
                    yield c
                yield chunk([choice_json(kind, finish_reason(r, reply.n_calls > 0), stream=True,
                                         logprobs=take_logprobs(""))], {"mtp": mtp_stats(r, api.engine)})
                if reply.include_usage:
                    yield chunk([], {"usage": reply_usage(api, r, reply)})
                break
            elif ev.kind == "error":
                err = {"error": {"message": f"the request failed: {ev.error}", "type": "server_error"}}
                yield f"data: {json.dumps(err)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        if not r.done:  # the client went away mid-stream: free its row
            r.cancel()


def finish_reason(r: Request, called: bool = False) -> str:
    """OpenAI's finish_reason of a finished request (`called`: its reply holds tool calls)."""
    if r.finish_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def usage(r: Request, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object of a request (`completion_tokens_details.reasoning_tokens` when the model reasons)."""
    out: dict[str, Any] = {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens),
                           "total_tokens": len(r.prompt) + len(r.tokens)}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def reply_usage(api: Any, r: Request, reply: Reply) -> dict[str, Any]:
    """`usage` of a finished request, its reasoning tokens counted when the reply is split (`Reply.reasons`)."""
    n = reply.reasoning_tokens(r.tokens, api.tokenizer.decode) if reply.reasons else None
    return usage(r, n)


def mtp_stats(r: Request, engine: Engine) -> dict[str, Any]:
    """The extension field `mtp`: the request's depth and acceptance."""
    return {"depth": r.depth, "cycles": r.cycles, "accepted_drafts": r.accepted,
            "acceptance": r.acceptance, "mean_accepted_length": r.mean_accepted_length}


__all__ = ["Reply", "choice_json", "engine_args", "finish_reason", "generate", "mtp_stats", "parse_request",
           "reply_usage", "usage"]
