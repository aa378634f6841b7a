"""OpenAI- and Anthropic-compatible serving: the HTTP app and the server around it.

`app` holds the routes and auth, `openai` the OpenAI handlers, `anthropic`
the Messages API, `tools` tool calling (checks, template messages, parsing
the reply), `params` and `fields` the request-field checks, `errors` the
400s; `server` loads a model and runs uvicorn.

The HTTP handlers only parse, queue work for the engine's thread and stream
its events back; every MLX call runs on the engine's thread.
"""

from mtplx_ext.serve.app import API, create_app
from mtplx_ext.serve.errors import BadRequest, error_response
from mtplx_ext.serve.server import load_chat_tokenizer, serve

__all__ = ["API", "BadRequest", "create_app", "error_response", "load_chat_tokenizer", "serve"]
