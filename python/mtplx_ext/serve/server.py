"""`serve`: the engine on its thread, the HTTP app on uvicorn, until SIGINT / SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mtplx_ext.batching import Engine
from mtplx_ext.batching.lockstep import LockstepEngine
from mtplx_ext.serve.app import API, create_app
from mtplx_ext.shipped import eos_ids


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
        """

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


def serve(
    runtime: Any,
    folder: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    max_batch: int = 8,
    depth: int = 1,
    use_mtp: bool = True,
    api_key: str | None = None,
    model_name: str | None = None,
    max_kv_slots: int | None = None,
    prefill_chunk: int = 256,
    log_level: str = "warning",
    prefix_cache_bytes: int = 256 << 20,
    group: Any = None,
    watchdog: Any = None,
) -> None:
    """Serves `runtime` until SIGINT / SIGTERM; the engine's thread runs every MLX call.

    With a distributed `group` (the runtime split across it), rank 0 serves
    HTTP and the other ranks step the same engine in lockstep
    (`batching.lockstep`) until rank 0 stops; `watchdog` is beaten at every
    engine step.
    """
    kwargs = dict(max_batch=max_batch, depth=depth, use_mtp=use_mtp, max_kv_slots=max_kv_slots,
                  prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes)
    if group is not None and group.rank() != 0:
        LockstepEngine(runtime, group, watchdog=watchdog, **kwargs).follow()
        return
    import uvicorn  # noqa: PLC0415

    if group is not None:
        engine: Engine = LockstepEngine(runtime, group, watchdog=watchdog, **kwargs)
    else:
        engine = Engine(runtime, **kwargs)
    api = API(engine, model_name or Path(folder).name, runtime.tokenizer, load_chat_tokenizer(folder), api_key,
              eos_ids(getattr(runtime, "tokenizer", None)))
    engine.start()
    try:
        server = _server_class()(uvicorn.Config(create_app(api), host=host, port=port, log_level=log_level))
        server.run()
    finally:
        engine.stop()


__all__ = ["load_chat_tokenizer", "serve"]
