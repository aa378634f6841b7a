"""`python -m mtplx_ext.train` / `mtplx-ext train`: flags -> `TrainConfig` -> a training run."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from mtplx_ext.train.trainer import TrainConfig, train

def parse_args(argv: list[str] | None = None) -> TrainConfig:
    defaults = TrainConfig(out="")
    p = argparse.ArgumentParser(prog="python -m mtplx_ext.train", description="Train a small qwen3 + MTP head model on the Python standard library.")
    p.add_argument("--out", required=True, help="output model folder")
    for name, value in asdict(defaults).items():
        if name == "out":
            continue
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    cfg = TrainConfig(**vars(args))
    for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "intermediate", "seq_len", "batch"):
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        p.error("--hidden must be divisible by --heads, and --heads by --kv-heads")
    if not 0.0 <= cfg.distill <= 1.0:
        p.error("--distill must be in [0, 1]")
    if cfg.trunk not in ("qwen3", "qwen3_next"):
        p.error("--trunk must be qwen3 or qwen3_next")
    if not 1 <= cfg.depth <= 8:
        p.error("--depth must be in 1..8")
    if not 1 <= cfg.mtp_layers <= 8:
        p.error("--mtp-layers must be in 1..8")
    if not 0.0 <= cfg.self_distill <= 1.0:
        p.error("--self-distill must be in [0, 1]")
    if cfg.self_distill > 0.0 and not cfg.init:
        p.error("--self-distill needs --init MODEL_DIR (a trained trunk writes the text)")
    for name in ("self_windows", "self_prompt", "self_new"):
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.freeze_trunk and not cfg.init:
        p.error("--freeze-trunk 1 needs --init MODEL_DIR (a trained trunk)")
    if cfg.minutes <= 0 and cfg.max_steps <= 0:
        p.error("give --minutes > 0 or --max-steps > 0")
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    summary = train(cfg)
    print(json.dumps({k: summary[k] for k in ("steps", "train_s", "heldout")}, indent=2))
