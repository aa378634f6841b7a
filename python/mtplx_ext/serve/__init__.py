"""OpenAI- and Anthropic-compatible serving: the HTTP app and the server around it.

`app` holds the routes and auth, `openai` the OpenAI handlers, `responses`
the Responses API (`responses_input`, `responses_output`, `responses_store`:
its request, its output items and events, its stored responses), `anthropic`
the Messages API, `tools` tool calling (checks, template messages, parsing
the reply), `reasoning` reasoning models (markers, the reasoning/answer
split, template fields and budgets), `params` and `fields` the request-field checks, `body` the
body's size limit and the JSON values nothing downstream can use, `errors`
the 400s, `disconnect` the hand-over of engine events and the watch for
clients that went away, `metrics` the Prometheus registry of `/metrics`;
`server` builds the API over a new engine (`build_api`), starts and warms
it up (`started`, `warmup`), binds the port and runs uvicorn with a bounded
shutdown (`serve`). `build_api` and
`started` also serve `create_app(api)` elsewhere: another ASGI server or
client in the same process.

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
    from mtplx_ext.serve.server import build_api, load_chat_tokenizer, serve, started

_LAZY = {"API": "app", "create_app": "app", "BadRequest": "errors", "error_response": "errors",
         "build_api": "server", "load_chat_tokenizer": "server", "serve": "server", "started": "server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"mtplx_ext.serve.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mtplx_ext.serve' has no attribute {name!r}")


__all__ = ["API", "BadRequest", "build_api", "create_app", "error_response", "load_chat_tokenizer", "serve", "started"]
