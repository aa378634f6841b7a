"""Shared helpers of the continuous-batching Engine tests: prompts, arrival schedules, a keyed draft head."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine


def random_prompt(rng: np.random.Generator, rt, lo: int = 1, hi: int = 40) -> list[int]:
    return rng.integers(0, rt.vocab_size, size=int(rng.integers(lo, hi + 1))).tolist()


def drive(eng: Engine, arrivals: list[tuple[int, dict]], max_steps: int = 5000, live: list | None = None) -> list:
    """Steps the engine, submitting arrivals[i] = (step, submit kwargs) at its step; checks the caps.

    `live`, when given, gets the live stream count after every step.
    """
    reqs = [None] * len(arrivals)
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    with eng.session():
        for step in range(max_steps):
            while pending and arrivals[pending[0]][0] <= step:
                i = pending.pop(0)
                reqs[i] = eng.submit(**arrivals[i][1])
            busy = eng.step()
            assert eng.live_streams <= eng.max_batch
            assert eng.kv_slots <= eng.max_kv_slots
            if live is not None:
                live.append(eng.live_streams)
            if not busy and not pending:
                return reqs
    raise AssertionError("engine did not finish")


def sampled_arrivals(rng: np.random.Generator, rt, n: int, hi: int = 30) -> list[dict]:
    """Submit kwargs of n seeded requests: nucleus / top-k, penalties + min-p, greedy, in turn."""
    out = []
    for i in range(n):
        kind = i % 3
        cfg = (
            SamplerConfig(temperature=float(rng.uniform(0.6, 1.5)), top_p=0.9, top_k=40)
            if kind == 0
            else SamplerConfig(temperature=0.9, min_p=0.05, frequency_penalty=0.4, presence_penalty=0.2)
            if kind == 1
            else SamplerConfig(temperature=0.0)
        )
        out.append(dict(prompt=random_prompt(rng, rt, 1, hi), max_tokens=int(rng.integers(4, 20)), sampler=cfg,
                        seed=int(rng.integers(0, 2**62))))
    return out


class KeyedHead:
    """A runtime whose head drafts from a table keyed by (position, token) instead of its own logits.

    Engine rows move between batches, so a draft cannot be scripted by row
    (as `_greedy.ScriptedHead` does); here the head pair at position t with
    token s[t + 1] drafts s[t + 2] of the sequence (prompt + reference)
    that has that pair, or, by a fixed coin per pair, a wrong token. With a
    random head almost every draft is rejected; this one gives every
    accepted length 0..K. The head still runs (its cache is exercised); the
    key rides in the normed states to `head_logits`, on the device.
    """

    def __init__(self, rt, seqs: list[list[int]], rng: np.random.Generator, p_right: float = 0.7):
        self.rt = rt
        V = rt.vocab_size
        self.width = max(len(s) for s in seqs) + 8
        table = np.zeros((self.width, V), np.int32)
        for s in seqs:
            for t in range(len(s) - 2):
                right = rng.random() < p_right
                table[t, s[t + 1]] = s[t + 2] if right else (s[t + 2] + 1) % V
        self.table = mx.array(table.reshape(-1))

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def head_states(self, hidden, next_tokens, head_cache):
        chained, normed = self.rt.head_states(hidden, next_tokens, head_cache)
        # The call advanced the head cache by T pairs: pair j sits at offset - T + j.
        T = next_tokens.shape[1]
        t = head_cache[0].offset[:, None] - T + mx.arange(T)[None]
        key = mx.clip(t, 0, self.width - 1) * self.rt.vocab_size + mx.maximum(next_tokens, 0)
        return chained, mx.zeros_like(normed) + key[..., None].astype(normed.dtype) + 0 * normed

    def head_logits(self, normed):
        want = mx.take(self.table, normed[..., 0].astype(mx.int32))
        V = self.rt.vocab_size
        return (mx.arange(V)[None, None] == want[..., None]).astype(normed.dtype) * 30.0
