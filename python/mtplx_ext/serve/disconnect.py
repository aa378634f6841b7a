"""Handing engine events to the event loop, and noticing a client that went away.

A non-streaming handler has nothing to write until its request ends, so it
would never see the connection drop: `final_event` waits for the request's
last event and, at the same time, for the ASGI `http.disconnect` message, and
returns None as soon as the client is gone so the handler cancels the
request (its row and KV are freed at the engine's next step).

`deliver` is the engine thread's side: it queues an event on the loop
unless the loop has already closed (a request ended by the engine's stop
after the server's loop finished has no reader left).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from mtplx_ext.batching import Event


def deliver(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[Event], None]:
    """An `on_event` callback (engine thread) that puts each event on `events` through `loop`."""

    def on_event(ev: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is reading
            loop.call_soon_threadsafe(events.put_nowait, ev)

    return on_event


async def _until_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_end(events: asyncio.Queue) -> Event:
    while True:
        ev = await events.get()
        if ev.kind in ("done", "error"):
            return ev


async def final_event(receive: Callable[[], Awaitable[dict[str, Any]]], events: asyncio.Queue) -> Event | None:
    """The request's "done" or "error" event, or None when the client disconnects first.

    `receive` is the request's ASGI receive, called only after its body was read.
    """
    end = asyncio.ensure_future(_until_end(events))
    gone = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((end, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (end, gone):
            t.cancel()
    if gone.done() and not gone.cancelled():
        gone.exception()  # a receive that failed means the connection is gone too
    if end.done() and not end.cancelled():
        return end.result()
    return None


async def finished(receive: Callable[[], Awaitable[dict[str, Any]]], events: asyncio.Queue, r: Any) -> Event | None:
    """`final_event`, with request `r` cancelled when its client went away first (then None)."""
    try:
        return await final_event(receive, events)
    finally:
        if not r.done:
            r.cancel()


__all__ = ["deliver", "final_event", "finished"]
