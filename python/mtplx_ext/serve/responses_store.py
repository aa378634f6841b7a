"""Stored responses (`store`, `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`): a bounded LRU in memory.

A stored response keeps its JSON (what `GET` returns) and the conversation
that produced it as chat messages (its input, earlier turns included,
then its own output; never the `instructions`, which OpenAI does not carry
over to the next response). A request naming it in `previous_response_id`
continues that conversation. The store holds at most `max_entries`
responses and `max_bytes` of their JSON text, least recently used first
out; a response evicted (or never stored, or deleted) is a 404 naming
`previous_response_id`, as OpenAI answers. Nothing survives a restart.

Every call runs on the server's event loop (one thread), so no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from starlette.responses import JSONResponse

from mtplx_ext.serve.errors import BadRequest, error_response

#: Most stored responses.
MAX_ENTRIES = 256
#: Most bytes of stored JSON (responses and their conversations), counted as their JSON text.
MAX_BYTES = 64 << 20


class NotFound(BadRequest):
    """A response id the store does not hold: OpenAI's 404 with its `code`."""

    def __init__(self, rid: str, param: str | None = "previous_response_id"):
        what = "Previous response" if param == "previous_response_id" else "Response"
        super().__init__(f"{what} with id {rid!r} not found (unknown, not stored, deleted or evicted)", param, 404)
        self.code = "previous_response_not_found" if param == "previous_response_id" else "not_found"

    def response(self) -> JSONResponse:
        """The refusal as OpenAI's error JSON, with its code."""
        return error_response(404, str(self), param=self.param, code=self.code)


class ResponseStore:
    """Stored responses by id, least recently used first out past `max_entries` or `max_bytes`."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, rid: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Stores a response and its conversation; False when it alone exceeds `max_bytes` (then not stored)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        self.delete(rid)
        if size > self.max_bytes:
            return False
        self.entries[rid] = (response, conversation, size)
        self.bytes += size
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, _, s) = self.entries.popitem(last=False)
            self.bytes -= s
        return True

    def get(self, rid: str, param: str | None = "previous_response_id") -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(response JSON, conversation) of a stored response, now the most recently used; `NotFound` otherwise."""
        entry = self.entries.get(rid)
        if entry is None:
            raise NotFound(rid, param)
        self.entries.move_to_end(rid)
        return entry[0], [dict(m) for m in entry[1]]

    def delete(self, rid: str) -> bool:
        """Forgets a response; whether it was stored."""
        entry = self.entries.pop(rid, None)
        if entry is None:
            return False
        self.bytes -= entry[2]
        return True


__all__ = ["MAX_BYTES", "MAX_ENTRIES", "NotFound", "ResponseStore"]
