"""The run loop both trainers share: step budget, learning-rate schedule per step, log lines, batches."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from mtplx_ext.train.loop import lr_at, run_loop, sample_windows
import _seed


@dataclass
class Cfg:
    lr: float
    warmup: int
    minutes: float = 0.0
    max_steps: int = 0


class Opt:
    learning_rate: float = 0.0


def test_the_loop_runs_the_step_budget_with_the_schedule_and_logs_every_tenth_step():
    rng = _seed.rng()
    cfg = Cfg(lr=float(rng.uniform(1e-4, 1e-2)), warmup=int(rng.integers(1, 6)), max_steps=int(rng.integers(21, 40)))
    opt, seen, losses = Opt(), [], rng.normal(size=cfg.max_steps)

    def step(seq):
        seen.append((opt.learning_rate, seq))
        i = len(seen) - 1
        return mx.array(losses[i]), mx.array(2 * losses[i])

    batches = [mx.array([[i]]) for i in range(cfg.max_steps)]
    it = iter(batches)
    log = io.StringIO()
    done = run_loop(cfg, opt, step, lambda: next(it), ("loss", "double"), log)
    assert done.steps == cfg.max_steps == len(seen)
    assert [lr for lr, _ in seen] == pytest.approx([lr_at(i / cfg.max_steps, cfg, i) for i in range(cfg.max_steps)])
    assert [int(s.item()) for _, s in seen] == list(range(cfg.max_steps))
    lines = [json.loads(l) for l in log.getvalue().splitlines()]
    assert [l["step"] for l in lines] == list(range(0, cfg.max_steps, 10))
    assert all(l["loss"] == pytest.approx(losses[l["step"]], rel=1e-6) for l in lines)
    ema = losses[0]
    for v in losses[1:]:
        ema = 0.95 * ema + 0.05 * v
    assert done.ema["loss"] == pytest.approx(ema, rel=1e-5) and done.ema["double"] == pytest.approx(2 * ema, rel=1e-5)


def test_lr_warms_up_then_decays_to_a_tenth():
    cfg = Cfg(lr=1e-3, warmup=4)
    assert lr_at(0.0, cfg, 0) == pytest.approx(2.5e-4)
    assert lr_at(0.0, cfg, 4) == pytest.approx(1e-3)
    assert lr_at(1.0, cfg, 100) == pytest.approx(1e-4)


def test_windows_are_slices_of_the_stream():
    rng = _seed.rng()
    tokens = rng.permutation(1000).astype(np.int32)  # distinct: a window's start gives its place
    w = np.array(sample_windows(rng, tokens, 6, 17))
    assert w.shape == (6, 17)
    for row in w:
        s = int(np.flatnonzero(tokens == row[0])[0])
        assert np.array_equal(row, tokens[s : s + 17])
    with pytest.raises(ValueError, match="windows of 17"):
        sample_windows(rng, tokens[:17], 1, 17)
