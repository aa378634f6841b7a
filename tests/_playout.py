"""Decodes played out with Bernoulli acceptance: the oracle of the depth-choice tests (not the predictor under test)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def simulated_tokens_per_s(costs, acc: Sequence[float], K: int, rng, cycles: int = 4000) -> float:
    """Tokens per second of `costs.batch` streams at depth K: each cycle accepts drafts while Bernoulli(a_j)
    succeeds, then commits one more (K = 0: one token per plain step)."""
    if K == 0:
        return costs.batch / costs.cycle_s["0"]
    ok = rng.random((cycles, K)) < np.asarray(acc[:K])
    accepted = np.where(ok.all(axis=1), K, np.argmin(ok, axis=1))
    return costs.batch * (1 + accepted.mean()) / costs.cycle_s[str(K)]


def play(reached: list[int], accepted: list[int], streams: int, k: int, acc: Sequence[float], rng) -> None:
    """`streams` more stream-cycles at depth k into running totals (per draft position, as `DraftStats` keeps
    them): draft j is reached when every earlier one was accepted, and accepted with probability acc[j]."""
    for _ in range(streams):
        for j in range(k):
            reached[j] += 1
            if rng.random() >= acc[j]:
                break
            accepted[j] += 1
