"""The Responses API's output items and their stream events: built in one place, streamed or not.

`Output` turns the reply's pieces (`("text", str)` and `("call", tool
call)` from `openai.Reply`, in order) into the response's `output` items
and, at the same time, the server-sent events that build them:
`response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` / `.done`, `response.content_part.done`,
`response.function_call_arguments.delta` / `.done`,
`response.output_item.done`, each with the stream's next
`sequence_number`. A non-streaming response pushes every piece through the
same `Output` and keeps only its items, so the two can never disagree.

Reasoning (`("reasoning", str)` pieces: the model's thinking, split off by
`Reply`) becomes one `reasoning` item first, as OpenAI's open-weight
models' servers return it: `summary: []` (no summaries are written) and the
text as `content: [{"type": "reasoning_text", "text"}]`, streamed as
`response.output_item.added`, `response.content_part.added`,
`response.reasoning_text.delta` / `.done`, `response.content_part.done`,
`response.output_item.done`; it closes when the answer's first piece comes.
Text becomes an assistant `message` item with one `output_text` part; each
call becomes a `function_call` item (its arguments sent whole, as the call
is parsed once complete). When tool calls are parsed, whitespace-only text
between calls opens no message (as the chat route's null content).
"""

from __future__ import annotations

import uuid
from typing import Any


def _id(prefix: str) -> str:
    return prefix + "_" + uuid.uuid4().hex[:24]


class Output:
    """The output items of one response and the events that stream them.

    Args:
        calls_parsed: tool calls are cut out of the reply (whitespace-only
            text between them is then not a message).
    """

    def __init__(self, calls_parsed: bool = False):
        self.calls_parsed = calls_parsed
        self.items: list[dict[str, Any]] = []
        self.seq = 0
        self.msg: dict[str, Any] | None = None  # the message item still open, if any
        self.thought: dict[str, Any] | None = None  # the reasoning item still open, if any
        self.pending = ""  # whitespace held until text follows it (calls parsed, no message open)
        self.lp: list[dict[str, Any]] = []  # token logprobs not sent yet: they go with the next text delta

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        """An event of the stream with its sequence number (lifecycle events go through here too)."""
        ev = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return ev

    def push(self, pieces: list[tuple[str, Any]], logprobs: list[dict[str, Any]] | None = None
             ) -> list[dict[str, Any]]:
        """The events of the next pieces of the reply, in order; `items` grows as they open.

        `logprobs` (OpenAI's per-token entries of the tokens that wrote these
        pieces) go out with the next text delta and into its message's part,
        as the chat route sends them: the tokens of a tool call count with
        the text after it (and with none after the last text).
        """
        self.lp += logprobs or []
        out: list[dict[str, Any]] = []
        for kind, p in pieces:
            if kind == "reasoning":
                out += self._reason(p)
                continue
            out += self._close_reasoning("completed")
            if kind == "text":
                out += self._text(p)
            elif kind == "call":
                out += self._close_message("completed")
                self.pending = ""
                out += self._call(p)
            else:  # pragma: no cover - the reply yields reasoning, text and calls only
                raise ValueError(f"unknown reply piece {kind!r}")
        return out

    def close(self, incomplete: bool = False) -> list[dict[str, Any]]:
        """The events that finish the output (an empty message when the reply produced no item)."""
        out = self._close_reasoning("incomplete" if incomplete else "completed")
        if self.msg is None and not self.items:
            out += self._open_message(self.pending)
        self.pending = ""
        if self.msg is not None:  # (the tokens of calls after the last text have no text to go with)
            self.msg["content"][0]["logprobs"] += self.lp
        self.lp = []
        out += self._close_message("incomplete" if incomplete else "completed")
        return out

    # -- items --------------------------------------------------------------------

    def _reason(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out: list[dict[str, Any]] = []
        if self.thought is None:
            self.thought = {"id": _id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                            "content": []}
            self.items.append(self.thought)
            index = len(self.items) - 1
            out.append(self.event("response.output_item.added", output_index=index, item=_copy(self.thought)))
            self.thought["content"].append({"type": "reasoning_text", "text": ""})
            out.append(self.event("response.content_part.added", item_id=self.thought["id"], output_index=index,
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        part = self.thought["content"][0]
        part["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.thought["id"],
                              output_index=self.items.index(self.thought), content_index=0, delta=text))
        return out

    def _close_reasoning(self, status: str) -> list[dict[str, Any]]:
        if self.thought is None:
            return []
        item, self.thought = self.thought, None
        index = self.items.index(item)
        part = item["content"][0]
        item["status"] = status
        return [
            self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=part["text"]),
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=dict(part)),
            self.event("response.output_item.done", output_index=index, item=_copy(item)),
        ]

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.msg is None:
            if self.calls_parsed and not text.strip():
                self.pending += text
                return []
            text, self.pending = self.pending + text, ""
            return self._open_message(text)
        return [self._delta(text)]

    def _open_message(self, text: str) -> list[dict[str, Any]]:
        self.msg = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.items.append(self.msg)
        index = len(self.items) - 1
        out = [self.event("response.output_item.added", output_index=index, item=_copy(self.msg))]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.msg["content"].append(part)
        out.append(self.event("response.content_part.added", item_id=self.msg["id"], output_index=index,
                              content_index=0, part={**part, "logprobs": []}))
        if text:
            out.append(self._delta(text))
        return out

    def _delta(self, text: str) -> dict[str, Any]:
        assert self.msg is not None
        part = self.msg["content"][0]
        part["text"] += text
        lp, self.lp = self.lp, []
        part["logprobs"] += lp
        return self.event("response.output_text.delta", item_id=self.msg["id"], output_index=len(self.items) - 1,
                          content_index=0, delta=text, logprobs=lp)

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self.msg is None:
            return []
        msg, self.msg = self.msg, None
        index = self.items.index(msg)
        part = msg["content"][0]
        msg["status"] = status
        return [
            self.event("response.output_text.done", item_id=msg["id"], output_index=index, content_index=0,
                       text=part["text"], logprobs=list(part["logprobs"])),
            self.event("response.content_part.done", item_id=msg["id"], output_index=index, content_index=0,
                       part={**part, "logprobs": list(part["logprobs"])}),
            self.event("response.output_item.done", output_index=index, item=_copy(msg)),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        f = call["function"]
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                "name": f["name"], "arguments": ""}
        self.items.append(item)
        index = len(self.items) - 1
        out = [self.event("response.output_item.added", output_index=index, item=dict(item))]
        item["arguments"] = f["arguments"]
        out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=f["arguments"]))
        out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=f["name"], arguments=f["arguments"]))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return out


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of a message or reasoning item (its parts and their logprobs copied, not shared)."""
    return {**item, "content": [{**p, "logprobs": list(p["logprobs"])} if "logprobs" in p else dict(p)
                                for p in item["content"]]}


def reasoning_text(items: list[dict[str, Any]]) -> str:
    """The text of the output's reasoning items, joined."""
    return "".join(p["text"] for it in items if it["type"] == "reasoning" for p in it.get("content") or []
                   if p["type"] == "reasoning_text")


def output_text(items: list[dict[str, Any]]) -> str:
    """The text of the output's messages, joined (what the official client's `output_text` reads)."""
    return "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"]
                   if p["type"] == "output_text")


__all__ = ["Output", "output_text", "reasoning_text"]
