"""The engine's own thread: every MLX call of a running engine happens on it.

`EngineThread` steps the engine while there is work and otherwise waits on
its inbox, so a submission wakes it at once; stopping ends every request
still open with an error event.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import mlx.core as mx


class EngineThread:
    """Runs `engine.step()` on a daemon thread until stopped.

    Args:
        engine: the `Engine` (its `session`, `step`, `admit`, `fail_all`).
        inbox: the queue `Engine.submit` puts requests on (None wakes the loop).
    """

    #: Seconds an idle engine waits on its inbox before looking at the stop flag again.
    IDLE_WAIT_S = 0.5

    def __init__(self, engine: Any, inbox: queue.SimpleQueue):
        self.engine = engine
        self.inbox = inbox
        self._stop = threading.Event()
        self.reason = "the engine stopped"
        self._thread = threading.Thread(target=self._run, name="mtplx-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None, reason: str = "the engine stopped") -> None:
        """Asks the loop to end (waking it through the inbox) and joins it for up to `timeout` s.

        Requests still open end with an error event saying `reason`.
        """
        self.reason = reason
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        eng = self.engine
        try:
            with eng.session():
                try:
                    while not self._stop.is_set():
                        if not eng.step():
                            try:
                                item = self.inbox.get(timeout=self.IDLE_WAIT_S)
                            except queue.Empty:
                                continue
                            if item is not None:
                                eng.admit(item)
                finally:
                    eng.fail_all(self.reason)
        finally:
            # MLX keeps per-thread stream state; a thread that ends with it
            # still set up (an exception included) makes the process abort at
            # exit ("terminate called without an active exception"): drain
            # and drop it.
            mx.synchronize()
            mx.clear_streams()


__all__ = ["EngineThread"]
