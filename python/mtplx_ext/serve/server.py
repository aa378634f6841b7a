"""`serve`: the engine on its thread, the HTTP app on uvicorn, until SIGINT / SIGTERM.

Shutdown (SIGINT / SIGTERM): stop accepting, let requests in flight finish
for `shutdown_grace` seconds, then end the rest with an error (an SSE error
event and `[DONE]` for a stream, never a cut connection), stop the engine
while the event loop still runs (its thread then has a loop to hand the
last events to), and exit with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from mtplx_ext.batching import Engine, EngineOptions
from mtplx_ext.batching.lockstep import LockstepEngine
from mtplx_ext.serve.app import API, create_app
from mtplx_ext.serve import limits, structured
from mtplx_ext.serve.warmup import warm_up
from mtplx_ext.shipped import eos_ids

#: The error a request still in flight when the grace period ends gets.
SHUTDOWN_MESSAGE = "the server is shutting down"


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet), so a taken port is known before the model loads.

    Raises:
        OSError: the address is taken or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def load_chat_tokenizer(folder: str | Path) -> Any:
    """mlx-lm's tokenizer wrapper of a model folder, when its tokenizer config has a chat template (else None)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer  # noqa: PLC0415

    tok = load_tokenizer(Path(folder))
    return tok if getattr(tok, "chat_template", None) else None


def _server_class() -> type:
    import uvicorn  # noqa: PLC0415

    class Server(uvicorn.Server):
        """uvicorn's server, for which SIGINT / SIGTERM are the normal end (exit status 0).

        uvicorn raises the caught signal again after its graceful shutdown;
        here the shutdown is the whole point of the signal, so it is not.
        Its shutdown waits for open connections; `engine` and `grace` bound
        that wait (see the module docstring).
        """

        engine: Engine
        grace: float

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            lock = threading.Lock()

            def stop_engine() -> None:  # ends the open requests; once (the second call finds it stopped)
                with lock:
                    self.engine.stop(10.0, SHUTDOWN_MESSAGE)

            async def end_the_rest() -> None:
                await asyncio.sleep(self.grace)
                await asyncio.to_thread(stop_engine)

            ender = asyncio.ensure_future(end_the_rest())
            try:
                await super().shutdown(sockets)
            finally:
                ender.cancel()
                await asyncio.to_thread(stop_engine)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server


def build_api(
    runtime: Any,
    folder: str | Path,
    *,
    max_batch: int = limits.DEFAULT_MAX_BATCH,
    depth: int | str = "auto",
    use_mtp: bool = True,
    api_key: str | None = None,
    model_name: str | None = None,
    max_kv_slots: int | None = None,
    prefill_chunk: int = limits.DEFAULT_PREFILL_CHUNK,
    prefix_cache_bytes: int = limits.DEFAULT_PREFIX_CACHE_MB << 20,
    max_body_bytes: int = limits.DEFAULT_MAX_BODY_BYTES,
    group: Any = None,
    watchdog: Any = None,
    reasoning_markers: Any = "auto",
    prefix_cache_dir: str | Path | None = None,
    prefix_cache_disk_bytes: int = limits.DEFAULT_PREFIX_CACHE_DISK_BYTES,
) -> API:
    """The `API` that `serve` serves: a new engine over `runtime` (not started yet) and `folder`'s chat template.

    The arguments are `serve`'s. With a distributed `group` the engine is
    rank 0's `LockstepEngine`. `started` runs it; `create_app(api)` is the
    ASGI app, for uvicorn (as `serve` runs it) or any other ASGI server or
    client (Starlette's TestClient, httpx's ASGI transport).
    """
    options = EngineOptions(max_batch=max_batch, depth=depth, use_mtp=use_mtp, max_kv_slots=max_kv_slots,
                            prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes)
    if prefix_cache_dir is not None:
        if group is not None:  # the ranks' caches must decide alike; a disk tier each would not
            raise ValueError("prefix_cache_dir is not supported with a distributed group")
        options = replace(options, prefix_cache_dir=prefix_cache_dir, prefix_cache_disk_bytes=prefix_cache_disk_bytes)
    if group is not None:
        engine: Engine = LockstepEngine(runtime, group, options, watchdog=watchdog)
    else:
        engine = Engine(runtime, options)
    return API(engine, model_name or Path(folder).name, runtime.tokenizer, load_chat_tokenizer(folder), api_key,
               eos_ids(getattr(runtime, "tokenizer", None)), max_body_bytes=max_body_bytes,
               reasoning_markers=reasoning_markers)


@contextlib.contextmanager
def started(api: API, *, warm: bool = True, log: Callable[[str], None] | None = None) -> Iterator[API]:
    """Starts `api`'s engine, warmed up (`warmup.warm_up`) when `warm`, and stops it when the block ends.

    `log` (default: stderr) says whether structured outputs are on
    (`structured.capability`) and how long the warm-up took. `serve` answers
    HTTP inside this block; so can any other server of `create_app(api)`.
    """
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    log(f"mtplx-ext serve: {structured.capability()}")
    api.engine.start()
    try:
        if warm:
            seconds, what = warm_up(api.engine)
            log(f"mtplx-ext serve: warmed up in {seconds:.2f} s ({what})")
        yield api
    finally:
        api.engine.stop()


def serve(
    runtime: Any,
    folder: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    max_batch: int = limits.DEFAULT_MAX_BATCH,
    depth: int | str = "auto",
    use_mtp: bool = True,
    api_key: str | None = None,
    model_name: str | None = None,
    max_kv_slots: int | None = None,
    prefill_chunk: int = limits.DEFAULT_PREFILL_CHUNK,
    log_level: str = "warning",
    prefix_cache_bytes: int = limits.DEFAULT_PREFIX_CACHE_MB << 20,
    sock: socket.socket | None = None,
    shutdown_grace: float = limits.DEFAULT_SHUTDOWN_GRACE_S,
    max_body_bytes: int = limits.DEFAULT_MAX_BODY_BYTES,
    warm: bool = True,
    log: Callable[[str], None] | None = None,
    group: Any = None,
    watchdog: Any = None,
    reasoning_markers: Any = "auto",
    prefix_cache_dir: str | Path | None = None,
    prefix_cache_disk_bytes: int = limits.DEFAULT_PREFIX_CACHE_DISK_BYTES,
) -> None:
    """Serves `runtime` until SIGINT / SIGTERM; the engine's thread runs every MLX call.

    `sock` is a socket from `bind` (else host:port is bound here); nothing
    answers on it until the warm-up (`warmup.warm_up`) is done, and `log`
    (default: stderr) says how long that took.

    With a distributed `group` (the runtime split across it), rank 0 serves
    HTTP and the other ranks step the same engine in lockstep
    (`batching.lockstep`) until rank 0 stops; `watchdog` is beaten at every
    engine step.
    """
    if not shutdown_grace >= 0:
        raise ValueError(f"shutdown_grace must be >= 0 seconds, got {shutdown_grace!r}")
    if group is not None and group.rank() != 0:
        options = EngineOptions(max_batch=max_batch, depth=depth, use_mtp=use_mtp, max_kv_slots=max_kv_slots,
                                prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes)
        LockstepEngine(runtime, group, options, watchdog=watchdog).follow()
        return
    import uvicorn  # noqa: PLC0415

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    api = build_api(runtime, folder, max_batch=max_batch, depth=depth, use_mtp=use_mtp, api_key=api_key,
                    model_name=model_name, max_kv_slots=max_kv_slots, prefill_chunk=prefill_chunk,
                    prefix_cache_bytes=prefix_cache_bytes, max_body_bytes=max_body_bytes, group=group,
                    watchdog=watchdog, reasoning_markers=reasoning_markers, prefix_cache_dir=prefix_cache_dir,
                    prefix_cache_disk_bytes=prefix_cache_disk_bytes)
    sock = sock if sock is not None else bind(host, port)
    try:
        with started(api, warm=warm, log=log):
            server = _server_class()(uvicorn.Config(create_app(api), log_level=log_level,
                                                    timeout_graceful_shutdown=int(shutdown_grace) + 5))
            server.engine, server.grace = api.engine, shutdown_grace
            name = sock.getsockname()
            log(f"mtplx-ext serve: ready on http://{name[0]}:{name[1]}")
            server.run(sockets=[sock])
    finally:
        sock.close()


__all__ = ["SHUTDOWN_MESSAGE", "bind", "build_api", "load_chat_tokenizer", "serve", "started"]
