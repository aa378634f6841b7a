"""OpenAI- and Anthropic-compatible serving: the HTTP app and the server around it.

`app` holds the routes and auth, `openai` the OpenAI handlers, `anthropic`
the Messages API, `tools` tool calling (checks, template messages, parsing
the reply), `params` and `fields` the request-field checks, `body` the
body's size limit and the JSON values nothing downstream can use, `errors`
the 400s, `disconnect` the hand-over of engine events and the watch for
clients that went away; `server` binds the port, warms the engine up
(`warmup`) and runs uvicorn with a bounded shutdown.

The HTTP handlers only parse, queue work for the engine's thread and stream
its events back; every MLX call runs on the engine's thread.

`limits` holds the defaults the CLI shows too; the names below load on first
use, so importing `mtplx_ext.serve.limits` needs no HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mtplx_ext.serve.app import API, create_app
    from mtplx_ext.serve.errors import BadRequest, error_response
    from mtplx_ext.serve.server import load_chat_tokenizer, serve

_LAZY = {"API": "app", "create_app": "app", "BadRequest": "errors", "error_response": "errors",
         "load_chat_tokenizer": "server", "serve": "server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"mtplx_ext.serve.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mtplx_ext.serve' has no attribute {name!r}")


__all__ = ["API", "BadRequest", "create_app", "error_response", "load_chat_tokenizer", "serve"]
