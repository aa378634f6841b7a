"""Training a tiny Gemma 4 pair on the standard library: the target, then its assistant.

    python -m mtplx_ext.train.gemma4 target --out PAIR/target [--minutes 12] ...
    python -m mtplx_ext.train.gemma4 assistant --target PAIR/target --out PAIR/assistant [--minutes 8] ...

Stage A trains a `gemma4_text` target (`gemma4_pair.TargetShape`) with
next-token cross-entropy; stage B trains a `gemma4_assistant` against that
target, frozen (`gemma4_pair.assistant_loss`). Both read the stdlib corpus
with the held-out rule of `corpus.split_files` and the shipped model's
tokenizer (vocabulary 2048), so no tokenizer is trained and held-out prompts
mean the same files as for the shipped model. The run loop, learning-rate
schedule and batches are `loop`'s, as for `mtplx_ext.train`.

Each stage writes a folder the package loads (`mtplx_ext.load(target,
drafter=assistant)`), with `train_summary.json`, `train_log.jsonl` and a
README (`gemma4_report`): the command, data, steps, minutes, machine,
held-out losses and, for the assistant, the teacher-forced agreement of its
step-1 / step-2 drafts with the target's argmax and the acceptance of greedy
MTP decoding of held-out prompts longer than the sliding window.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from mtplx_ext import _blas
from mtplx_ext.checkpoints import load, read_tokenizer
from mtplx_ext.batching import generate_greedy_batched
from mtplx_ext.shipped import EOS_TOKEN, SHIPPED_MODEL
from mtplx_ext.train import gemma4_pair as pair
from mtplx_ext.train import gemma4_report as report
from mtplx_ext.train.corpus import encode_files, split_files, stdlib_files, stdlib_root
from mtplx_ext.train.loop import run_loop, sample_windows
from mtplx_ext.train.trainer import file_start_prompts


@dataclass
class Common:
    """Run settings both stages share (recorded in the folders' READMEs)."""

    out: str = ""
    seq_len: int = 128
    batch: int = 8
    lr: float = 2e-3
    warmup: int = 30
    minutes: float = 12.0
    max_steps: int = 0
    heldout_per_mille: int = 50
    eval_tokens: int = 16384
    seed: int = 0
    #: Use only the first N training and N held-out files (0: all); for quick checks.
    max_files: int = 0
    #: 1: the training step goes through mx.compile (faster per step; tracing a
    #: Gemma 4 step costs tens of seconds once, more than a few-step check runs).
    compile: int = 1


@dataclass
class TargetRun(pair.TargetShape, Common):
    """Stage A: the target's shape and run."""

    #: Folder whose tokenizer.json is used (default: the shipped model's).
    tokenizer: str = ""


@dataclass
class AssistantRun(pair.AssistantShape, Common):
    """Stage B: the assistant's shape and run against a trained target folder."""

    target: str = ""
    minutes: float = 8.0
    lr: float = 1e-3
    #: Chained draft steps trained (the engine chains steps at decode time).
    depth: int = 2
    #: Share of each step's target taken from the target model's distribution.
    distill: float = 0.7
    decode_prompts: int = 8
    prompt_tokens: int = 64
    new_tokens: int = 96


# -- data ------------------------------------------------------------------------


def corpus_tokens(tok: Any, heldout_per_mille: int, max_files: int = 0) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train, held-out) token streams of the stdlib, each file followed by EOS, and their counts."""
    root = stdlib_root()
    files = stdlib_files(root)
    if not files:
        raise RuntimeError(f"no Python sources found under {root}")
    train_files, held_files = split_files(files, root, heldout_per_mille)
    if max_files > 0:
        train_files, held_files = train_files[:max_files], held_files[:max_files]
    train, held = encode_files(tok, train_files), encode_files(tok, held_files)
    info = {"python": platform.python_version(), "train_files": len(train_files), "heldout_files": len(held_files),
            "train_tokens": int(len(train)), "heldout_tokens": int(len(held))}
    print(f"data: {info['train_files']} train files ({len(train):,} tokens) / {info['heldout_files']} held-out "
          f"({len(held):,}) from {root}", flush=True)
    return train, held, info


def heldout_windows(tokens: np.ndarray, length: int, max_tokens: int) -> np.ndarray:
    """Consecutive [n, length] windows from the start of the held-out stream (at most `max_tokens`)."""
    n = min(len(tokens), max_tokens) // length
    if n == 0:
        raise ValueError(f"not enough held-out tokens ({len(tokens)}) for a window of {length}")
    return tokens[: n * length].reshape(n, length)


def machine() -> dict:
    """Where the run ran (recorded in the summary and README)."""
    return {"cpus": os.cpu_count(), "machine": platform.machine(), "system": platform.system(),
            "mlx": mx.__version__, "blas": _blas.describe()}


# -- the shared run ----------------------------------------------------------------


def _fit(cfg: Common, module: nn.Module, loss: Callable, train: np.ndarray, names: tuple[str, ...],
         extra_inputs: list | None = None) -> tuple[dict, Any]:
    """AdamW on `module`'s trainable parameters through `loop.run_loop`; the log goes to out/train_log.jsonl."""
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=0.01)
    loss_and_grad = nn.value_and_grad(module, loss)
    state = [module.state, opt.state, mx.random.state]

    def _step(seq: mx.array):
        (value, parts), grads = loss_and_grad(seq)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(module, grads)
        return (value, *parts)

    run = mx.compile(_step, inputs=state + (extra_inputs or []), outputs=state) if cfg.compile else _step

    def step(seq: mx.array):
        res = run(seq)
        mx.eval(state, res)
        return res

    rng = np.random.default_rng(cfg.seed)
    log = (Path(cfg.out) / "train_log.jsonl").open("w")
    done = run_loop(cfg, opt, step, lambda: sample_windows(rng, train, cfg.batch, cfg.seq_len + 1), names, log)
    return {"steps": done.steps, "train_s": round(done.train_s, 1), "final_train_ema": done.ema,
            "train_tokens_seen": done.steps * cfg.batch * cfg.seq_len}, log


def _finish(cfg: Common, summary: dict, log: Any, t0: float) -> dict:
    log.write(json.dumps({"heldout": summary["heldout"]}) + "\n")
    log.close()
    summary.update(total_s=round(time.time() - t0, 1), machine=machine())
    (Path(cfg.out) / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# -- stage A: the target ------------------------------------------------------------


def evaluate_target(trunk: nn.Module, held: np.ndarray, seq_len: int, max_tokens: int, batch: int = 8) -> dict:
    """Held-out next-token cross-entropy and top-1 accuracy over windows of `seq_len` + 1."""
    w = heldout_windows(held, seq_len + 1, max_tokens)
    ce = top1 = 0.0
    for i in range(0, len(w), batch):
        seq = mx.array(w[i : i + batch])
        logits = trunk(seq[:, :-1]).astype(mx.float32)
        c = nn.losses.cross_entropy(logits, seq[:, 1:], reduction="mean")
        t = mx.mean(mx.argmax(logits, axis=-1) == seq[:, 1:])
        mx.eval(c, t)
        ce += c.item() * seq.shape[0]
        top1 += t.item() * seq.shape[0]
    return {"target_ce": ce / len(w), "target_top1": top1 / len(w), "windows": len(w)}


def train_target(cfg: TargetRun) -> dict:
    """Stage A: trains the target and writes its folder to `cfg.out`; returns the summary."""
    t0 = time.time()
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    tok = read_tokenizer(Path(cfg.tokenizer or SHIPPED_MODEL))
    if tok is None:
        raise ValueError(f"--tokenizer {cfg.tokenizer}: the folder has no tokenizer.json")
    cfg.vocab_size = tok.get_vocab_size()
    train, held, data = corpus_tokens(tok, cfg.heldout_per_mille, cfg.max_files)
    mx.random.seed(cfg.seed)
    shape = pair.TargetShape(**{f.name: getattr(cfg, f.name) for f in fields(pair.TargetShape)})
    rt = pair.build_target(shape, tok)
    trunk = rt.trunk
    n_params = sum(v.size for _, v in tree_flatten(trunk.parameters()))
    print(f"target: {n_params / 1e6:.2f}M parameters, layers {rt.config['layer_types']}", flush=True)
    summary, log = _fit(cfg, trunk, lambda s: pair.target_loss(trunk, s), train, ("loss", "target_ce"))
    summary["heldout"] = evaluate_target(trunk, held, cfg.seq_len, cfg.eval_tokens)
    print("held-out:", json.dumps(summary["heldout"]), flush=True)
    rt.save(cfg.out)
    summary.update(config=asdict(cfg), params=n_params, data=data, layer_types=rt.config["layer_types"])
    summary = _finish(cfg, summary, log, t0)
    report.write_target_readme(cfg.out)
    return summary


# -- stage B: the assistant -----------------------------------------------------------


def evaluate_assistant(a: Any, trunk: nn.Module, held: np.ndarray, cfg: AssistantRun, batch: int = 8) -> dict:
    """Held-out losses and teacher-forced agreement of draft steps 1..max(depth, 2) with the target's argmax.

    Step k at position p agrees when its argmax equals the target's argmax at
    p + k - 1 (fed the data's tokens, as trained): the test a greedy draft
    passes to be accepted when the earlier drafts of its cycle were.
    """
    depth = max(cfg.depth, 2)
    w = heldout_windows(held, cfg.seq_len + 1, cfg.eval_tokens)
    tot: dict[str, float] = {"step1_ce": 0.0, "step1_soft_ce": 0.0, **{f"agree_{k}": 0.0 for k in range(1, depth + 1)}}
    for i in range(0, len(w), batch):
        seq = mx.array(w[i : i + batch])
        tokens = seq[:, :-1]
        states = pair.target_states(trunk, tokens)
        steps = pair.assistant_logits(a, trunk, tokens, states, depth)
        ce, soft = pair.step_losses(steps[:1], seq, states.logits)[0]
        stats = {"step1_ce": ce, "step1_soft_ce": soft}
        for k, logits in enumerate(steps, start=1):
            n = logits.shape[1]
            want = mx.argmax(states.logits[:, k : k + n], axis=-1)
            stats[f"agree_{k}"] = mx.mean(mx.argmax(logits, axis=-1) == want)
        mx.eval(stats)
        for key, v in stats.items():
            tot[key] += v.item() * seq.shape[0]
    return {k: v / len(w) for k, v in tot.items()} | {"windows": len(w)}


def decode_acceptance(rt: Any, prompts: list[list[int]], new_tokens: int, depths: list[int]) -> dict:
    """Greedy MTP decoding of `prompts` as one batch at each depth: acceptance by draft position,
    mean accepted drafts per cycle, and whether every stream equals plain greedy decoding."""
    plain = generate_greedy_batched(rt, prompts, max_new_tokens=new_tokens, use_mtp_draft=False)
    out: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": len(prompts[0]) if prompts else 0,
                           "new_tokens": new_tokens}
    for d in depths:
        r = generate_greedy_batched(rt, prompts, max_new_tokens=new_tokens, depth=d)
        out[f"depth_{d}"] = {
            "acceptance_per_depth": r.acceptance_per_depth,
            "mean_accepted_length": r.mean_accepted_length,
            "same_tokens_as_plain": sum(a.tokens == b.tokens for a, b in zip(r.streams, plain.streams)),
        }
    return out


def save_assistant(a: Any, config: dict, out: str | Path, tokenizer: Any = None) -> Path:
    """Writes an MLX drafter folder (config.json, model.safetensors[, tokenizer.json]) as `convert --drafter` does."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(a.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
    return out


def train_assistant(cfg: AssistantRun) -> dict:
    """Stage B: trains an assistant against the frozen target folder `cfg.target`; writes `cfg.out`."""
    t0 = time.time()
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    target = load(cfg.target, fuse_cpu_ops=False)
    if target.tokenizer is None:
        raise ValueError(f"--target {cfg.target}: the folder has no tokenizer.json")
    trunk = target.trunk
    trunk.freeze()
    train, held, data = corpus_tokens(target.tokenizer, cfg.heldout_per_mille, cfg.max_files)
    mx.random.seed(cfg.seed)
    shape = pair.AssistantShape(**{f.name: getattr(cfg, f.name) for f in fields(pair.AssistantShape)})
    a, config = pair.build_assistant(target, shape)
    n_params = sum(v.size for _, v in tree_flatten(a.parameters()))
    print(f"assistant: {n_params / 1e6:.2f}M parameters, layers {a.layer_types}", flush=True)
    summary, log = _fit(cfg, a, lambda s: pair.assistant_loss(a, trunk, s, cfg.depth, cfg.distill), train,
                        ("loss", "step1_ce", "step1_soft_ce"), extra_inputs=[trunk.state])
    summary["heldout"] = evaluate_assistant(a, trunk, held, cfg)
    save_assistant(a, config, cfg.out, target.tokenizer)
    rt = load(cfg.target, drafter=cfg.out)
    eos = target.tokenizer.token_to_id(EOS_TOKEN)
    prompts = file_start_prompts(held, eos, cfg.decode_prompts, cfg.prompt_tokens)
    summary["heldout"]["decode"] = decode_acceptance(rt, prompts, cfg.new_tokens, [1, 2, 3])
    print("held-out:", json.dumps(summary["heldout"]), flush=True)
    target_summary = Path(cfg.target) / "train_summary.json"
    summary.update(config=asdict(cfg), params=n_params, data=data, sliding_window=trunk.args.sliding_window,
                   target=json.loads(target_summary.read_text()) if target_summary.is_file() else None)
    summary = _finish(cfg, summary, log, t0)
    report.write_assistant_readme(cfg.out)
    return summary


# -- command line ----------------------------------------------------------------------


def _add_fields(p: argparse.ArgumentParser, cls: type, required: tuple[str, ...]) -> None:
    for f in fields(cls):
        flag = f"--{f.name.replace('_', '-')}"
        if f.name in required:
            p.add_argument(flag, required=True)
        else:
            default = f.default
            p.add_argument(flag, type=type(default), default=default)


def parse_args(argv: list[str] | None = None) -> TargetRun | AssistantRun:
    """Flags -> a stage's config; bad values exit naming the flag."""
    p = argparse.ArgumentParser(prog="python -m mtplx_ext.train.gemma4", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="stage", required=True)
    _add_fields(sub.add_parser("target", help="stage A: a gemma4_text target"), TargetRun, ("out",))
    _add_fields(sub.add_parser("assistant", help="stage B: its assistant, target frozen"), AssistantRun,
                ("out", "target"))
    ns = vars(p.parse_args(argv))
    stage = ns.pop("stage")
    cfg: TargetRun | AssistantRun = TargetRun(**ns) if stage == "target" else AssistantRun(**ns)
    for name in ("seq_len", "batch", "heldout_per_mille", "eval_tokens"):
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.minutes <= 0 and cfg.max_steps <= 0:
        p.error("give --minutes > 0 or --max-steps > 0")
    if isinstance(cfg, TargetRun):
        try:
            pair.check_target_shape(cfg)
        except ValueError as e:
            p.error(f"--{str(e).split(' ')[0].replace('_', '-')}: {e}")
    else:
        if not 1 <= cfg.depth <= 4:
            p.error("--depth must be in 1..4")
        if not 0.0 <= cfg.distill <= 1.0:
            p.error("--distill must be in [0, 1]")
        if min(cfg.hidden, cfg.heads, cfg.intermediate, cfg.prompt_tokens, cfg.new_tokens, cfg.decode_prompts) < 1:
            p.error("--hidden, --heads, --intermediate, --prompt-tokens, --new-tokens and --decode-prompts must be >= 1")
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    summary = train_target(cfg) if isinstance(cfg, TargetRun) else train_assistant(cfg)
    print(json.dumps({k: summary[k] for k in ("steps", "train_s", "heldout")}, indent=2))


if __name__ == "__main__":
    main()


__all__ = [
    "AssistantRun", "Common", "TargetRun", "corpus_tokens", "decode_acceptance", "evaluate_assistant",
    "evaluate_target", "heldout_windows", "machine", "main", "parse_args", "save_assistant", "train_assistant",
    "train_target",
]
