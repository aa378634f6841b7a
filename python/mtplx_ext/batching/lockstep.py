"""Continuous batching across the ranks of a distributed model: every rank steps one `Engine` in lockstep.

In a tensor- or pipeline-parallel run every forward holds collectives, so
every rank must run the same engine steps on the same rows. Rank 0 alone
takes requests (its HTTP server calls `submit` and `Request.cancel`); at
the start of each step it decides what the step admits and cancels and
sends it to every rank with `mx.distributed`:

1. one `all_gather` of a fixed-size int32 control vector per rank: rank
   0's payload length and stop flag, and every rank's running hash of the
   tokens it committed (checked equal: a rank that diverged is reported at
   the next step, naming the step, instead of hanging later);
2. when the payload is not empty, its bytes (JSON: the new requests with
   their chosen seeds, the ids cancelled) as int32, sent by an `all_sum` in
   which the other ranks add zeros.

Everything else the step does depends only on that and on device results
identical on every rank, so the batches, cycles and commits agree. A
cancellation becomes part of the run only when it is sent: a request that
the client cancels between two steps is dropped at the step after, on
every rank alike. A raising event callback cancels its request the same
way rather than failing it on rank 0 alone.

Rank 0 steps even when idle (every `EngineThread.IDLE_WAIT_S`), so its
control messages double as heartbeats; the other ranks run `follow`, which
steps until rank 0 sends the stop flag (its `stop`). A `Watchdog` beaten at
every exchange ends a rank whose peers stopped answering.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext.batching import admission
from mtplx_ext.batching.collective import (
    DistributedError,
    Watchdog,
    all_gather_ints,
    broadcast,
    is_transport_error,
    lost_peer_message,
)
from mtplx_ext.batching.engine import Engine
from mtplx_ext.batching.options import EngineOptions
from mtplx_ext.batching.requests import Event, Request, RowSettings
from mtplx_ext.batching.rows import RowRecord
from mtplx_ext.batching.steps import StepResult
from mtplx_ext.sampling import SamplerConfig

_SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


def _to_ints(data: bytes) -> np.ndarray:
    pad = (-len(data)) % 4
    return np.frombuffer(data + b"\0" * pad, dtype=np.int32).copy()


class LockstepEngine(Engine):
    """An `Engine` whose steps run in lockstep on every rank of `group`.

    Args:
        runtime: a runtime split across `group` (`checkpoints.sharded.load`).
        group: the `mx.distributed.Group`; rank 0 takes requests.
        watchdog: beaten at every exchange (None: no watchdog).
        options, **kwargs: as for `Engine`; `depth="auto"` (the default) agrees across
            ranks only after `collective.agree_auto_depth(group, runtime,
            [max_batch])` (the CLI calls it); ranks that disagree are
            reported at the next step, by the committed-token hash.
    """

    per_batch_depth = False  # one K, agreed by the ranks

    def __init__(self, runtime: Any, group: Any, options: EngineOptions | None = None, *,
                 watchdog: Watchdog | None = None, **kwargs: Any):
        super().__init__(runtime, options, **kwargs)
        self.group = group
        self.rank = group.rank()
        self.watchdog = watchdog
        self._pending: list[RowRecord] = []  # submitted on rank 0, not sent yet
        self._agreed: set[int] = set()  # ids sent to every rank
        self._known: dict[int, RowRecord] = {}
        self._cancelled: set[int] = set()  # cancellations sent to every rank
        self._crc = 0
        self.exchanges = 0
        self.closed = False  # the stop flag went out (rank 0) or came in
        self._stop_wanted = False

    # -- rank 0: what a step sends ----------------------------------------------

    def submit(self, prompt: Sequence[int], **kwargs: Any) -> Request:
        if self.rank != 0:
            raise RuntimeError("LockstepEngine.submit: only rank 0 takes requests")
        if kwargs.get("constraint") is not None:  # a grammar's matcher state cannot be sent to the other ranks
            raise ValueError("constraint (structured outputs) is not supported across ranks yet")
        cb = kwargs.pop("on_event", None)
        holder: list[Request] = []

        def on_event(ev: Event) -> None:  # a raising callback cancels (on every rank), never fails on one
            if cb is None:
                return
            try:
                cb(ev)
            except Exception:  # noqa: BLE001
                if holder:
                    holder[0].cancel()

        r = super().submit(prompt, on_event=on_event, **kwargs)
        holder.append(r)
        return r

    def request_stop(self) -> None:
        """Rank 0: the next exchange tells every rank to stop (then `stop` the engine thread)."""
        self._stop_wanted = True
        self._inbox.put(None)

    def stop(self, timeout: float | None = 30.0, reason: str = "the engine stopped") -> None:
        if self.rank == 0 and self._thread is not None and not self.closed:
            self.request_stop()
            # The engine thread sends the flag at its next step (at most one idle wait away).
            end = time.monotonic() + (timeout or 30.0)
            while not self.closed and time.monotonic() < end and self._thread is not None:
                time.sleep(0.02)
        super().stop(timeout, reason)

    def admit(self, r: RowRecord) -> None:
        if r.id not in self._agreed:  # taken off the inbox by the idle loop: sent at the next step
            self._pending.append(r)
            return
        super().admit(r)

    def _message(self, new: list[RowRecord]) -> bytes:
        cancel = [rid for rid, r in self._known.items() if r.cancelled and rid not in self._cancelled and not r.done]
        if not new and not cancel:
            return b""
        specs = [
            {"id": r.id, "prompt": r.prompt, "max_tokens": r.max_tokens, "seed": r.seed,
             "stop_ids": sorted(r.stop_ids), "stop": list(r.stop),
             "depth": r.depth, "logprobs": r.logprobs,
             "sampler": {**{f: getattr(r.sampler, f) for f in _SAMPLER_FIELDS},
                         "logit_bias": [list(e) for e in r.sampler.logit_bias]}}
            for r in new
        ]
        return json.dumps({"new": specs, "cancel": cancel}).encode()

    # -- every rank: the exchange -------------------------------------------------

    def take_inbox(self) -> list[RowRecord]:
        """The step's agreed admissions, in rank 0's order; cancellations marked; the stop flag read."""
        if self.closed:
            return []
        new: list[RowRecord] = []
        payload = b""
        if self.rank == 0:
            new = self._pending + super().take_inbox()
            self._pending = []
            payload = self._message(new)
        stop = 1 if (self.rank == 0 and self._stop_wanted) else 0
        ctl = all_gather_ints(self.group, [len(payload), stop, self._crc & 0x7FFFFFFF, self.exchanges & 0x7FFFFFFF])
        self.exchanges += 1
        if self.watchdog is not None:
            self.watchdog.beat()
        if len({(int(c), int(n)) for c, n in ctl[:, 2:]}) > 1:
            self.closed = True
            self.fail_all("the ranks diverged")
            raise DistributedError(
                f"the ranks committed different tokens before step {self.exchanges} (per-rank hash, step: "
                f"{ctl[:, 2:].tolist()})"
            )
        n = int(ctl[0, 0])
        if n:
            words = broadcast(self.group, _to_ints(payload) if self.rank == 0 else None, (n + 3) // 4)
            msg = json.loads(words.astype(np.int32).tobytes()[:n].decode())
            if self.rank != 0:
                new = [self._request(s) for s in msg["new"]]
            self._cancelled.update(msg["cancel"])
            for rid in msg["cancel"]:
                r = self._known.get(rid)
                if r is not None and self.rank != 0:
                    r.req.cancel()  # (no client here: rank 0's cancellation, mirrored)
        else:
            new = [] if self.rank != 0 else new
        for r in new:
            self._agreed.add(r.id)
            self._known[r.id] = r
        if int(ctl[0, 1]):
            self.closed = True
        return new

    def _request(self, spec: dict) -> RowRecord:
        """Rank > 0: the record of the request rank 0 built, from its sent fields."""
        fields = dict(spec["sampler"])
        fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields.get("logit_bias", ()))
        stops = admission.check_stops(spec["stop"], self.tokenizer is not None)
        settings = RowSettings(SamplerConfig(**fields), int(spec["seed"]), int(spec["max_tokens"]),
                               frozenset(spec["stop_ids"]), stops, int(spec["depth"]), spec["logprobs"])
        prompt = list(spec["prompt"])
        need = admission.request_need(len(prompt), settings.max_tokens, self.depth, self.mtp)
        return RowRecord.new(int(spec["id"]), prompt, settings, need, tokenizer=self.tokenizer)

    # -- the step -----------------------------------------------------------------

    def step(self) -> StepResult:
        if self.closed:
            return StepResult()
        try:
            res = super().step()
        except DistributedError as e:  # every rank sees the same gathered hashes: all end here
            os.write(2, f"mtplx-ext: error: rank {self.rank}: {e}; exiting\n".encode())
            os._exit(4)
        except RuntimeError as e:  # a peer gone: no later step could complete
            if not is_transport_error(e):
                raise
            os.write(2, f"mtplx-ext: error: {lost_peer_message(self.rank, e)}\n".encode())
            os._exit(4)
        for rid in [rid for rid, r in self._known.items() if r.done]:
            del self._known[rid]
            self._cancelled.discard(rid)
        if self.closed:  # the stop flag: no step after this one holds a collective
            self.fail_all("the engine stopped")
            res = replace(res, finished=res.finished + tuple(self._log.finished))  # they end in this step
            self._log.clear()
        return res

    def _drop_cancelled(self) -> None:
        # Only cancellations every rank has been sent (never a flag set since the exchange).
        for q in (self._waiting, self._ready):
            for r in [r for r in q if r.id in self._cancelled]:
                q.remove(r)
                self._finish(r, "cancelled")
        for r in self._live:
            if r.id in self._cancelled and r.finish_reason is None:
                self._finish(r, "cancelled")

    def _commit_host(self, r: RowRecord, new: list[int], reason: str | None, valid: bool = True,
                     lp: Any = None) -> None:
        self._crc = zlib.crc32(np.asarray([r.id, *new], dtype=np.int64).tobytes(), self._crc)
        super()._commit_host(r, new, reason, valid, lp=lp)

    def follow(self) -> None:
        """Rank > 0: steps in lockstep with rank 0 until it sends the stop flag."""
        if self.rank == 0:
            raise RuntimeError("LockstepEngine.follow runs on the ranks other than 0")
        with self.session():
            while not self.closed:
                self.step()
        mx.synchronize()


__all__ = ["LockstepEngine"]
