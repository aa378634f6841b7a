"""Servers for the serve tests, in this process: `mtplx-ext serve FLAGS` (`LiveServer`), or the app over a
scripted engine (`AppThread.scripted`), on uvicorn in a thread. (`mtplx-ext serve` as a process: `_live_server`.)

`ScriptedEngine` stands in for `Engine` where a test must steer the model's
output (a tool call the shipped code model would never write): it answers
every request with `reply`'s tokens, in chunks of random sizes, through the
real `Request` / `Detokenizer` / `Event` path, and records each prompt.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import _seed
from mtplx_ext.batching import Detokenizer, Request, RowSettings
from mtplx_ext.serve import API, build_api, create_app, load_chat_tokenizer, started
from mtplx_ext.serve.server import bind
from mtplx_ext.shipped import SHIPPED_MODEL, eos_ids

#: The API key of the shared live server (`tests/serve/conftest.py`): a bearer token or x-api-key.
KEY = "k-" + os.urandom(4).hex()

#: A Qwen-style chat template with tools (written for these tests): tools in a
#: system block, calls as <tool_call>{json}</tool_call>, results as <tool_response>.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for tool_call in m.tool_calls or [] %}{%- if tool_call.function %}{% set tool_call = tool_call.function %}"
    "{% endif %}<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_model_folder(tmp: Path) -> Path:
    """A folder with the shipped tokenizer and `TOOL_TEMPLATE` (what mlx-lm's tokenizer loader reads)."""
    import json

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.json").write_bytes((Path(SHIPPED_MODEL) / "tokenizer.json").read_bytes())
    cfg = json.loads((Path(SHIPPED_MODEL) / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp


class ScriptedEngine:
    """An `Engine` stand-in whose every reply is `reply` (cut at max_tokens), streamed in random chunks."""

    depth, mtp = 2, True

    def __init__(self, tokenizer: Any, seed: int | None = None):
        self.tokenizer = tokenizer
        self.vocab = tokenizer.get_vocab_size()
        self.reply = ""
        self.prompts: list[list[int]] = []
        self.rng = np.random.default_rng(_seed.fresh() if seed is None else seed)

    def submit(self, prompt: list[int], *, on_event: Any = None, max_tokens: int = 64, sampler: Any = None,
               stop: Any = (), seed: int | None = None, stop_token_ids: Any = (), constraint: Any = None,
               logprobs: Any = None) -> Request:
        settings = RowSettings(sampler, seed or 0, max_tokens, frozenset(stop_token_ids), tuple(stop), self.depth)
        r = Request(len(self.prompts), list(prompt), settings, on_event)
        self.prompts.append(list(prompt))
        ids = self.tokenizer.encode(self.reply).ids[:max_tokens]
        cuts = sorted({0, len(ids), *self.rng.integers(0, len(ids) + 1, size=max(len(ids) // 3, 1)).tolist()})
        detok = Detokenizer(self.tokenizer, tuple(stop))
        threading.Thread(target=self._run, args=(r, detok, ids, cuts), daemon=True).start()
        return r

    def _run(self, r: Request, detok: Detokenizer, ids: list[int], cuts: list[int]) -> None:
        for a, b in zip(cuts, cuts[1:]):
            new = ids[a:b]
            text, cut = detok.push(new, final=b == len(ids))
            r.commit(new, text)
            if cut:
                break
            time.sleep(0.001)
        r.finish("length" if len(r.tokens) >= r.max_tokens else "stop")

    def metrics(self) -> dict:
        return {}


class AppThread:
    """`create_app(api)` on uvicorn, in a thread, on a port of 127.0.0.1 bound here (real TCP: the official
    clients, raw sockets, keep-alive and clients that go away all behave as against `mtplx-ext serve`)."""

    def __init__(self, api: API):
        import uvicorn

        self.api = api
        self.sock = bind("127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(api), log_level="warning",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @classmethod
    def scripted(cls, engine: Any, folder: Path, api_key: str | None = None, model_name: str = "stub") -> "AppThread":
        """The app over a `ScriptedEngine` (no warm-up, nothing to start) with `folder`'s chat template."""
        return cls(API(engine, model_name, engine.tokenizer, load_chat_tokenizer(folder), api_key,
                       eos_ids(engine.tokenizer)))

    def __enter__(self) -> "AppThread":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise AssertionError("the app did not start in 30 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the app did not shut down in 30 s"


class _Handed(Exception):
    """Raised in place of `serve`: the CLI has handed it everything."""


def cli_serve_args(*flags: str) -> tuple[Any, Path, dict[str, Any]]:
    """What `mtplx-ext serve FLAGS` hands `serve`: (runtime, folder, keyword arguments).

    The CLI runs as it does in its own process (flag checks, the model loaded
    as it loads it, --depth auto calibrated) up to the call of `serve`, which
    is caught; its socket (port 0 here) is closed again.
    """
    from mtplx_ext import cli
    from mtplx_ext.serve import server

    got: dict[str, Any] = {}

    def hand(runtime: Any, folder: Any, **kwargs: Any) -> None:
        got.update(runtime=runtime, folder=Path(folder), kwargs=kwargs)
        raise _Handed

    real = server.serve
    server.serve = hand
    try:
        code = cli.main(["serve", *flags, "--port", "0"])
        raise AssertionError(f"mtplx-ext serve {' '.join(flags)} never reached serve (status {code})")
    except _Handed:
        return got["runtime"], got["folder"], got["kwargs"]
    finally:
        server.serve = real


class LiveServer:
    """`mtplx-ext serve FLAGS` in this process: what the CLI makes of FLAGS (`cli_serve_args`), served as
    `serve` serves it (`build_api`, the engine `started` and warmed up), by uvicorn in a thread (`AppThread`).

    What needs the process itself (signals, exit status, the process's memory,
    the interpreter's start and end) is tested against `mtplx-ext serve` in a
    subprocess (`_live_server`); everything else against this.
    """

    def __init__(self, *flags: str, warm: bool = True):
        import inspect

        runtime, folder, kwargs = cli_serve_args(*flags)
        own = inspect.signature(build_api).parameters
        self.runtime = runtime
        self.api = build_api(runtime, folder, **{k: v for k, v in kwargs.items() if k in own})
        self.key = self.api.api_key
        self.warm = warm
        self.log: list[str] = []
        self.app = AppThread(self.api)
        self.base = self.app.base
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "LiveServer":
        with contextlib.ExitStack() as stack:
            stack.enter_context(started(self.api, warm=self.warm, log=self.log.append))
            stack.enter_context(self.app)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()  # the app, then the engine (as `serve` ends)
