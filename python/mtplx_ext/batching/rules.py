"""`RequestRules`: what an engine accepts of a request, checked before anything is queued."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mtplx_ext._checks import as_int, as_prompts, as_seed, as_stop_ids
from mtplx_ext.batching.admission import (capacity, check_callback, check_context, check_sampler, check_stops,
                                          request_depth, request_need)
from mtplx_ext.batching.constrained import check_constraint
from mtplx_ext.batching.requests import RowSettings
from mtplx_ext.batching.rows import RowRecord
from mtplx_ext.batching.token_logprobs import check_logprobs
from mtplx_ext.sampling import SamplerConfig


@dataclass(frozen=True)
class RequestRules:
    """What an engine accepts of a request (its vocabulary, K, context and KV cap): `request` checks the
    client's fields into the request's `RowSettings` and builds its record (and the client's `Request`), before
    anything is queued. A new per-request feature adds its field to `RowSettings` and its check here."""

    vocab: int
    depth: int
    mtp: bool
    context: int
    max_kv_slots: int
    tokenizer: Any = None

    def request(self, rid: int, prompt: Any, rng: np.random.Generator, *, max_tokens: int = 64,
                sampler: SamplerConfig | None = None, stop_token_ids: Sequence[int] = (),
                stop: Sequence[str] | str = (), seed: int | None = None, on_event: Callable | None = None,
                logprobs: int | None = None, depth: int | None = None, constraint: Any = None) -> RowRecord:
        """The checked request's record, its handle as `.req` (`Engine.submit`'s arguments; a None seed is drawn
        from `rng`).

        Raises:
            TypeError / ValueError: naming the bad argument; a request that could never fit.
        """
        if isinstance(prompt, (str, bytes)):
            raise TypeError("prompt must be a list of token ids, got a string (tokenize it first)")
        prompt = as_prompts([prompt], self.vocab)[0]
        max_tokens = as_int("max_tokens", max_tokens, lo=1)
        sampler = check_sampler(sampler, self.vocab)
        logprobs = check_logprobs(logprobs)
        stop_ids = as_stop_ids(stop_token_ids, self.vocab)
        stops = check_stops(stop, self.tokenizer is not None)
        seed = as_seed("seed", seed)
        seed = int(rng.integers(0, 2**63)) if seed is None else seed
        check_callback(on_event)
        depth = request_depth(depth, self.depth, self.mtp)
        constraint = check_constraint(constraint)
        check_context(len(prompt), max_tokens, self.context)
        need = request_need(len(prompt), max_tokens, self.depth, self.mtp)
        if (slots := capacity(need)) > self.max_kv_slots:
            raise ValueError(f"the request needs {slots} KV slots, more than max_kv_slots={self.max_kv_slots}")
        settings = RowSettings(sampler, seed, max_tokens, stop_ids, stops, depth, logprobs, constraint)
        return RowRecord.new(rid, prompt, settings, need, on_event, self.tokenizer)


__all__ = ["RequestRules"]
