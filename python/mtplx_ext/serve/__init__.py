"""OpenAI-compatible serving: the HTTP app (`app`) and the server around it (`server`).

The HTTP handlers only parse, queue work for the engine's thread and stream
its events back; every MLX call runs on the engine's thread.
"""

from mtplx_ext.serve.app import API, create_app, error_response
from mtplx_ext.serve.server import load_chat_tokenizer, serve

__all__ = ["API", "create_app", "error_response", "load_chat_tokenizer", "serve"]
