"""The training loop every trainer here shares: budget, learning-rate schedule, batches, log, progress.

A run is limited either by steps (`max_steps` > 0) or by wall-clock minutes;
the learning rate follows `lr_at` (linear warmup, cosine decay to 10 % of the
peak) over the fraction of that budget already spent, so a run cut by time
still anneals. Each step trains on `batch` random windows of the training
token stream (`sample_windows`). Every 10 steps a JSON line goes to the log
(and to stdout when tqdm is missing); the loop returns the step count, the
training seconds and the moving averages of the step's named losses.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, TextIO

import mlx.core as mx
import numpy as np


class Schedule(Protocol):
    """The fields of a training config the loop reads."""

    lr: float
    warmup: int
    minutes: float
    max_steps: int


def lr_at(frac: float, cfg: Schedule, step: int) -> float:
    """Linear warmup over `cfg.warmup` steps, then cosine decay to 10% of the peak.

    Args:
        frac: fraction of the run done (by steps, or by time when the run
            is limited by --minutes).
    """
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, max(0.0, frac))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def progress(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar, or None without tqdm (the loop then prints its log lines)."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=2.0)
    except ImportError:  # tqdm comes with mlx-lm; plain log lines without it
        return None


def sample_windows(rng: np.random.Generator, tokens: np.ndarray, batch: int, length: int) -> mx.array:
    """[batch, length] windows starting at uniform random offsets of `tokens` (int32).

    Raises:
        ValueError: fewer than `length + 1` tokens.
    """
    if len(tokens) <= length:
        raise ValueError(f"{len(tokens)} training tokens cannot give windows of {length}")
    starts = rng.integers(0, len(tokens) - length, size=batch)
    return mx.array(np.stack([tokens[s : s + length] for s in starts]))


@dataclass
class LoopResult:
    """What the loop did: steps taken, seconds spent, final moving averages by loss name."""

    steps: int
    train_s: float
    ema: dict[str, float | None]


def run_loop(
    cfg: Schedule,
    opt: Any,
    step: Callable[[mx.array], Sequence[mx.array]],
    sample: Callable[[], mx.array],
    names: Sequence[str],
    log: TextIO,
    desc: str = "train",
) -> LoopResult:
    """Trains until the step or time budget of `cfg` is spent.

    Args:
        cfg: lr, warmup and the budget (`max_steps` > 0 wins over `minutes`).
        opt: the optimizer; its `learning_rate` is set before every step.
        step: trains on one batch and returns its losses, evaluated, in the
            order of `names` (the first is the one optimized).
        sample: the next batch.
        names: the losses' names in the log and the returned averages.
        log: JSON lines every 10 steps.
    """
    budget_s = cfg.minutes * 60
    by_steps = cfg.max_steps > 0
    bar = progress(cfg.max_steps if by_steps else int(budget_s), desc, "step" if by_steps else "s")
    t0 = time.time()
    ema: tuple[float, ...] | None = None
    n = 0
    while True:
        elapsed = time.time() - t0
        if (by_steps and n >= cfg.max_steps) or (not by_steps and elapsed >= budget_s):
            break
        frac = n / cfg.max_steps if by_steps else elapsed / budget_s
        opt.learning_rate = lr_at(frac, cfg, n)
        vals = tuple(float(v.item()) for v in step(sample()))
        ema = vals if ema is None else tuple(0.95 * e + 0.05 * v for e, v in zip(ema, vals))
        if n % 10 == 0:
            rec = {"step": n, **dict(zip(names, vals)), "lr": float(opt.learning_rate),
                   "elapsed_s": round(time.time() - t0, 1)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if bar is None:
                print(json.dumps(rec), flush=True)
        if bar is not None:
            bar.set_postfix(step=n, **{k: f"{v:.3f}" for k, v in zip(names[1:], ema[1:])}, refresh=False)
            bar.update(1 if by_steps else min(int(time.time() - t0), int(budget_s)) - bar.n)
        n += 1
    if bar is not None:
        bar.close()
    return LoopResult(n, time.time() - t0, dict(zip(names, ema or (None,) * len(names))))


__all__ = ["LoopResult", "Schedule", "lr_at", "progress", "run_loop", "sample_windows"]
