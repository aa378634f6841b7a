"""Train the small MTP model shipped with the package.

A `qwen3` trunk and a Qwen3-Next-style MTP head are trained jointly (loss =
next-token cross-entropy through the trunk + token-after-next cross-entropy
through the head) on the Python standard library's own source files, which
every machine with Python has. A byte-level BPE tokenizer is trained first on
the same training files. Some files are held out, chosen by a hash of their
path, for evaluation.

Usage:
    python -m mtplx_ext.train --out model_dir [--minutes 40] [--hidden 256] ...

The run is reproducible for a given Python version (its stdlib is the data),
seed and flags; the output folder's README records all of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

# Importing the package first loads the fast BLAS before mlx.core.
import mtplx_ext  # noqa: F401  isort: skip

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mtplx_ext.checkpoint import add_mtp_modules

EOS = "<|endoftext|>"
# Parts of the stdlib tree that are not ordinary Python source: installed
# packages, test suites, generated encoding tables and doc data.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "encodings", "pydoc_data", "__pycache__"}


# -- data --------------------------------------------------------------------


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Python source files of the standard library, sorted by relative path."""
    root = root or stdlib_root()
    files = []
    # os.walk with pruning: site-packages alone can hold far more files than the stdlib.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            # _sysconfigdata*: machine-specific build settings, not library code.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(rel_path: str, heldout_per_mille: int = 50) -> bool:
    """Deterministic split: a file is held out when crc32 of its path falls low."""
    return zlib.crc32(rel_path.encode()) % 1000 < heldout_per_mille


def split_files(files: list[Path], root: Path, heldout_per_mille: int = 50) -> tuple[list[Path], list[Path]]:
    """(train, heldout) by :func:`is_heldout` on each file's relative path."""
    train, held = [], []
    for p in files:
        (held if is_heldout(p.relative_to(root).as_posix(), heldout_per_mille) else train).append(p)
    return train, held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int):
    """A byte-level BPE tokenizer trained on `files` with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return tok


def encode_files(tok, files: list[Path]) -> np.ndarray:
    """All files' tokens, each followed by EOS, as one int32 stream."""
    eos = tok.token_to_id(EOS)
    out = []
    # Batches keep memory flat while using the tokenizer's own threads.
    for i in range(0, len(files), 64):
        chunk = files[i : i + 64]
        for enc in tok.encode_batch([read_text(p) for p in chunk]):
            out.append(np.asarray(enc.ids, dtype=np.int32))
            out.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(out) if out else np.zeros((0,), np.int32)


# -- model -------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Everything that decides the run (recorded in the model's README)."""

    out: str
    vocab_size: int = 2048
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    seq_len: int = 256
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 100
    minutes: float = 40.0
    max_steps: int = 0
    head_weight: float = 1.0
    distill: float = 0.0
    heldout_per_mille: int = 50
    eval_tokens: int = 32768
    seed: int = 0
    #: Chained head steps trained (loss at t + 2 .. t + depth + 1).
    depth: int = 1
    #: A trained model folder to start from (its tokenizer and weights).
    init: str = ""
    #: 1: train the head only (the trunk, embedding and lm_head stay as loaded).
    freeze_trunk: int = 0
    #: Trunk family: "qwen3" (attention only) or "qwen3_next" (GatedDeltaNet
    #: hybrid, one attention layer every `full_attention_interval`).
    trunk: str = "qwen3"
    full_attention_interval: int = 4
    #: MTP layers of the head (depth k trains layer (k - 1) % layers); an
    #: --init folder with fewer gets copies of its last layer.
    mtp_layers: int = 1


def build_runtime(cfg: TrainConfig, tokenizer):
    """A random qwen3 (or qwen3_next) trunk + Qwen3-Next-style head from the package's model code."""
    hybrid = {}
    if cfg.trunk == "qwen3_next":
        hd = cfg.hidden // cfg.heads
        hybrid = dict(
            full_attention_interval=cfg.full_attention_interval, linear_num_value_heads=cfg.heads,
            linear_num_key_heads=cfg.kv_heads, linear_key_head_dim=hd, linear_value_head_dim=hd,
            num_experts=0, shared_expert_intermediate_size=cfg.intermediate, moe_intermediate_size=cfg.intermediate,
        )
    rt = mtplx_ext.init_random(
        cfg.trunk,
        cfg.seed,
        head_layout="qwen3_next",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads,
        intermediate_size=cfg.intermediate,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        num_nextn_predict_layers=cfg.mtp_layers,
        **hybrid,
    )
    # init_random spreads the embedding for random-model tests; for training,
    # rows of norm ~1 give tied-embedding logits of unit scale at the start.
    emb = rt.trunk.model.embed_tokens
    emb.weight = mx.random.normal(emb.weight.shape, scale=1.0 / math.sqrt(cfg.hidden))
    rt.tokenizer = tokenizer
    return rt


def joint_loss(
    rt,
    seq: mx.array,
    head_weight: float,
    distill: float = 0.0,
    depth: int = 1,
    train_trunk: bool = True,
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    """Trunk next-token CE + the head's CE at depths 1..`depth` on [B, T+1] windows.

    Depth 1: the head sees the trunk's state at t and the true token t + 1
    and predicts t + 2. Depth k > 1 is the head applied again, as at decode
    time: it sees its own output state of depth k - 1 and the true token
    t + k, and predicts t + k + 1 (teacher forcing). A head with several MTP
    modules runs module (k - 1) % modules at depth k (DeepSeek's sequential
    MTP objective).

    Args:
        rt: the runtime being trained.
        seq: [B, T + 1] token windows.
        head_weight: weight of the head's loss (the mean over depths).
        distill: share of the head's target taken from the trunk's own
            (detached) distribution at the predicted position instead of
            the data's token. Drafts are accepted when they match the
            trunk, not the data, so this aims the head at acceptance.
        depth: chained head steps.
        train_trunk: False leaves the trunk's loss out (a frozen trunk).

    Returns:
        (loss, (trunk CE, head CE against the data at depth 1)).
    """
    inputs, targets = seq[:, :-1], seq[:, 1:]
    logits, hidden = rt.forward(inputs)
    logits = logits.astype(mx.float32)
    trunk_ce = nn.losses.cross_entropy(logits, targets, reduction="mean")
    if not train_trunk:
        logits, hidden = mx.stop_gradient(logits), mx.stop_gradient(hidden)
    T = targets.shape[1]
    h = hidden
    head_losses, head_ce1 = [], None
    for k in range(1, depth + 1):
        n = T - k  # positions t whose token t + k + 1 is in the window
        head_logits, h = rt.head_forward(
            h[:, :n], targets[:, k - 1 : k - 1 + n], return_hidden=True, module=(k - 1) % len(rt.mtp_modules)
        )
        head_logits = head_logits.astype(mx.float32)
        ce = nn.losses.cross_entropy(head_logits, targets[:, k : k + n], reduction="mean")
        loss_k = ce
        if distill > 0.0:
            teacher = mx.softmax(mx.stop_gradient(logits[:, k : k + n]), axis=-1)
            soft_ce = -(teacher * nn.log_softmax(head_logits, axis=-1)).sum(axis=-1).mean()
            loss_k = (1.0 - distill) * ce + distill * soft_ce
        head_losses.append(loss_k)
        head_ce1 = ce if head_ce1 is None else head_ce1
    head_loss = sum(head_losses) / len(head_losses)
    total = (trunk_ce if train_trunk else 0.0) + head_weight * head_loss
    return total, (trunk_ce, head_ce1)


def evaluate(rt, tokens: np.ndarray, seq_len: int, max_tokens: int, batch: int = 8, depth: int = 1) -> dict:
    """Held-out losses and the head's teacher-forced greedy agreement per depth.

    Agreement at depth k is the fraction of positions where the head's
    argmax after k chained steps (true tokens fed, as `joint_loss` trains)
    equals the trunk's own argmax for that token: the test a greedy draft
    must pass to be accepted. `agree` is depth 1.
    """
    n = min(len(tokens), max_tokens) // (seq_len + 1)
    if n == 0:
        raise ValueError("not enough held-out tokens to evaluate")
    windows = tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)
    tot = {"trunk_ce": 0.0, "head_ce": 0.0, "trunk_top1": 0.0}
    tot.update({f"agree_{k}": 0.0 for k in range(1, depth + 1)})
    count = 0
    for i in range(0, n, batch):
        seq = mx.array(windows[i : i + batch])
        inputs, targets = seq[:, :-1], seq[:, 1:]
        logits, hidden = rt.forward(inputs)
        trunk_pred = mx.argmax(logits, axis=-1)
        T = targets.shape[1]
        stats = {
            "trunk_ce": nn.losses.cross_entropy(logits, targets, reduction="mean"),
            "trunk_top1": mx.mean(trunk_pred == targets),
        }
        h = hidden
        for k in range(1, depth + 1):
            m = T - k
            head_logits, h = rt.head_forward(
                h[:, :m], targets[:, k - 1 : k - 1 + m], return_hidden=True, module=(k - 1) % len(rt.mtp_modules)
            )
            if k == 1:
                stats["head_ce"] = nn.losses.cross_entropy(head_logits, targets[:, 1:], reduction="mean")
            stats[f"agree_{k}"] = mx.mean(mx.argmax(head_logits, axis=-1) == trunk_pred[:, k : k + m])
        mx.eval(stats)
        b = seq.shape[0]
        for key, v in stats.items():
            tot[key] += v.item() * b
        count += b
    out = {key: v / count for key, v in tot.items()}
    out["agree"] = out["agree_1"]
    return out


def lr_at(frac: float, cfg: TrainConfig, step: int) -> float:
    """Linear warmup over `cfg.warmup` steps, then cosine decay to 10% of the peak.

    Args:
        frac: fraction of the run done (by steps, or by time when the run
            is limited by --minutes).
    """
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, max(0.0, frac))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _progress(total: int, desc: str, unit: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=2.0)
    except ImportError:  # tqdm comes with mlx-lm; plain log lines without it
        return None


def heldout_decode_acceptance(rt, held_tokens: np.ndarray, eos: int, n_prompts: int = 8,
                              prompt_len: int = 32, new_tokens: int = 96) -> dict:
    """Greedy MTP decoding from the starts of held-out files: the real acceptance rate."""
    from mtplx_ext.engine import generate_greedy_batched

    starts = [0] + [int(i) + 1 for i in np.flatnonzero(held_tokens == eos)[:-1]]
    prompts = []
    for s in starts:
        window = held_tokens[s : s + prompt_len]
        if len(window) == prompt_len and eos not in window:
            prompts.append([int(t) for t in window])
        if len(prompts) == n_prompts:
            break
    res = generate_greedy_batched(rt, prompts, max_new_tokens=new_tokens)
    single = [generate_greedy_batched(rt, [p], max_new_tokens=new_tokens).acceptance_rate for p in prompts]
    return {
        "prompts": len(prompts),
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "acceptance_batch": res.acceptance_rate,
        "acceptance_single_mean": float(np.mean(single)),
    }


def train(cfg: TrainConfig) -> dict:
    """Runs the whole pipeline and writes the model folder to `cfg.out`."""
    t_start = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    root = stdlib_root()
    files = stdlib_files(root)
    if not files:
        raise RuntimeError(f"no Python sources found under {root}")
    train_files, held_files = split_files(files, root, cfg.heldout_per_mille)
    print(f"data: {len(train_files)} train / {len(held_files)} held-out files from {root}", flush=True)

    t = time.time()
    start = mtplx_ext.load(cfg.init, fuse_cpu_ops=False) if cfg.init else None
    if start is not None and start.tokenizer is None:
        raise ValueError(f"--init {cfg.init}: the folder has no tokenizer.json")
    tok = start.tokenizer if start is not None else train_tokenizer(train_files, cfg.vocab_size)
    train_tokens = encode_files(tok, train_files)
    held_tokens = encode_files(tok, held_files)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_tokens):,} train / "
        f"{len(held_tokens):,} held-out tokens ({time.time() - t:.0f}s)",
        flush=True,
    )

    mx.random.seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    if start is not None:  # the shape is the loaded model's (recorded in its README)
        c = start.config
        cfg.vocab_size, cfg.hidden, cfg.layers = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]
        cfg.heads, cfg.kv_heads, cfg.intermediate = (
            c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
        )
    rt = start if start is not None else build_runtime(cfg, tok)
    if len(rt.mtp_modules) > cfg.mtp_layers:
        raise ValueError(f"--init {cfg.init} has {len(rt.mtp_modules)} MTP layers, more than --mtp-layers {cfg.mtp_layers}")
    add_mtp_modules(rt, cfg.mtp_layers)
    if cfg.freeze_trunk:
        rt.trunk.freeze()  # embedding and lm_head too: the head shares them
    n_params = sum(v.size for _, v in _flatten(rt.parameters()))
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=0.01)
    loss_and_grad = nn.value_and_grad(rt, lambda s: joint_loss(rt, s, cfg.head_weight, cfg.distill, cfg.depth, not cfg.freeze_trunk))
    state = [rt.state, opt.state, mx.random.state]

    def _step(seq):
        (loss, parts), grads = loss_and_grad(seq)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(rt, grads)
        return loss, parts[0], parts[1]

    step_fn = mx.compile(_step, inputs=state, outputs=state)

    def sample() -> mx.array:
        starts = rng.integers(0, len(train_tokens) - cfg.seq_len - 1, size=cfg.batch)
        return mx.array(np.stack([train_tokens[s : s + cfg.seq_len + 1] for s in starts]))

    def run_step(seq):
        res = step_fn(seq)
        mx.eval(state, res)
        return res

    log_path = out / "train_log.jsonl"
    log = log_path.open("w")
    budget_s = cfg.minutes * 60
    by_steps = cfg.max_steps > 0
    bar = _progress(cfg.max_steps if by_steps else int(budget_s), "train", "step" if by_steps else "s")
    t_train = time.time()
    ema = None
    step = 0
    while True:
        elapsed = time.time() - t_train
        if (by_steps and step >= cfg.max_steps) or (not by_steps and elapsed >= budget_s):
            break
        frac = step / cfg.max_steps if by_steps else elapsed / budget_s
        opt.learning_rate = lr_at(frac, cfg, step)
        loss, trunk_ce, head_ce = run_step(sample())
        vals = (loss.item(), trunk_ce.item(), head_ce.item())
        ema = vals if ema is None else tuple(0.95 * e + 0.05 * v for e, v in zip(ema, vals))
        if step % 10 == 0:
            rec = {"step": step, "loss": vals[0], "trunk_ce": vals[1], "head_ce": vals[2],
                   "lr": float(opt.learning_rate), "elapsed_s": round(time.time() - t_train, 1)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if bar is None:
                print(json.dumps(rec), flush=True)
        if bar is not None:
            bar.set_postfix(step=step, trunk=f"{ema[1]:.3f}", head=f"{ema[2]:.3f}", refresh=False)
            bar.update(1 if by_steps else min(int(time.time() - t_train), int(budget_s)) - bar.n)
        step += 1
    total = step
    if bar is not None:
        bar.close()
    train_s = time.time() - t_train

    heldout = evaluate(rt, held_tokens, cfg.seq_len, cfg.eval_tokens, depth=max(cfg.depth, 3))
    heldout["decode"] = heldout_decode_acceptance(rt, held_tokens, tok.token_to_id(EOS))
    print("held-out:", json.dumps(heldout), flush=True)
    log.write(json.dumps({"heldout": heldout}) + "\n")
    log.close()

    rt.save(out)
    summary = {
        "config": asdict(cfg),
        "params": n_params,
        "steps": total,
        "train_tokens_seen": total * cfg.batch * cfg.seq_len,
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "train_tokens": int(len(train_tokens)),
        "heldout_tokens": int(len(held_tokens)),
        "final_train_ema": dict(zip(("loss", "trunk_ce", "head_ce"), ema or (None,) * 3)),
        "heldout": heldout,
        "train_s": round(train_s, 1),
        "total_s": round(time.time() - t_start, 1),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "blas": mtplx_ext._blas.describe(),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_model_readme(out)
    return summary


def command_line(cfg: dict, out: str | None = None) -> str:
    """The command that reproduces a run with config `cfg`."""
    parts = ["python -m mtplx_ext.train", f"--out {out or cfg['out']}"]
    for name, value in cfg.items():
        if name != "out":
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def write_model_readme(folder: str | Path) -> Path:
    """Writes README.md for a trained model folder from its train_summary.json."""
    folder = Path(folder)
    s = json.loads((folder / "train_summary.json").read_text())
    cfg, held, dec = s["config"], s["heldout"], s["heldout"].get("decode", {})
    ema = s["final_train_ema"]
    lam = float(cfg.get("distill", 0.0))
    distill_text = (
        f"; the head's target is {1 - lam:g} x the data's token t + 2 + {lam:g} x the trunk's own"
        " (detached) distribution at t + 1, because drafts are accepted when they match the trunk"
        if lam > 0
        else ""
    )
    trunk = cfg.get("trunk", "qwen3")
    hybrid = (
        f" (GatedDeltaNet layers, full attention every {cfg.get('full_attention_interval')} layers)"
        if trunk == "qwen3_next"
        else ""
    )
    text = f"""# {folder.name}: a tiny {trunk} model with a Qwen3-Next-style MTP head

Trained by `mtplx_ext.train` so that `mtplx-ext generate` and `mtplx-ext bench`
work offline. It writes Python-looking code; it is a test and benchmark
model, not a useful code model.

- Trunk: mlx-lm `{trunk}`{hybrid}, hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['heads']} attention
  heads ({cfg['kv_heads']} KV heads), MLP {cfg['intermediate']}, tied embeddings, vocabulary {cfg['vocab_size']}.
- MTP head: Qwen3-Next layout (`mtp.*`: two RMSNorms, fc 2H -> H, one
  attention decoder layer, final norm; embedding and lm_head shared).
- {s['params'] / 1e6:.2f}M parameters, float32.
- Tokenizer: byte-level BPE trained with the `tokenizers` library on the
  training files below (`tokenizer.json`, end-of-text token `<|endoftext|>`).

## Data

The Python {s['python']} standard library's own `.py` source files (the
directories `test`, `tests`, `encodings`, `pydoc_data` and `site-packages`
excluded). These files are distributed under the Python Software Foundation
License (PSF License Agreement for Python); this model is trained on them.
A file is held out for evaluation when `crc32(relative path) % 1000 <
{cfg['heldout_per_mille']}`: {s['train_files']} training files ({s['train_tokens']:,} tokens),
{s['heldout_files']} held-out files ({s['heldout_tokens']:,} tokens).

## Training

Joint loss: next-token cross-entropy through the trunk + {cfg['head_weight']} x
token-after-next cross-entropy through the head (the head sees the trunk's
hidden state at t and the true token t + 1){distill_text}. AdamW (weight decay 0.01), peak
learning rate {cfg['lr']}, {cfg['warmup']} warmup steps then cosine decay to 10 %, gradient
clipping 1.0, batch {cfg['batch']} x {cfg['seq_len']} tokens, seed {cfg['seed']}.

    {command_line(cfg, 'MODEL_DIR')}

- Steps: {s['steps']} ({s['train_tokens_seen']:,} training tokens seen), {s['train_s'] / 60:.1f} min of
  training, {s['total_s'] / 60:.1f} min in all, on a shared 2-core x86-64 CPU (MLX {s['mlx']} CPU
  backend, BLAS: {s['blas']}).
- Final training losses (moving average): trunk {ema['trunk_ce']:.3f}, head {ema['head_ce']:.3f}.
- Held-out losses ({min(cfg['eval_tokens'], s['heldout_tokens']):,} tokens, windows of {cfg['seq_len']}):
  trunk {held['trunk_ce']:.3f}, head {held['head_ce']:.3f}; trunk top-1 accuracy {held['trunk_top1']:.3f}.
- Head greedy agreement on held-out text (the head's argmax from (h_t,
  x_t+1) equals the trunk's argmax at t + 1, teacher-forced): {held['agree']:.3f}.
"""
    depths = sorted(int(k.split("_")[1]) for k in held if k.startswith("agree_"))
    if depths:
        text += "- Agreement by depth (the head applied k times, teacher-forced): " + ", ".join(
            f"k = {k}: {held[f'agree_{k}']:.3f}" for k in depths
        ) + ".\n"
    if cfg.get("init"):
        text += f"""- Started from the trained model in `{Path(cfg['init']).name}`"""
        text += (
            "; only the head was trained (trunk, embedding and lm_head frozen)"
            if cfg.get("freeze_trunk")
            else ""
        )
        text += f""", with the depth-{cfg.get('depth', 1)} objective: the head
  applied {cfg.get('depth', 1)} times (its own output state and the true next token fed
  back, as a depth-K decode feeds it its drafts), cross-entropy at t + 2 .. t +
  {cfg.get('depth', 1) + 1}, averaged over depths.
"""
    if dec:
        text += f"""- Greedy MTP decoding acceptance rate, prompts = the first {dec['prompt_tokens']} tokens of
  {dec['prompts']} held-out files, {dec['new_tokens']} new tokens each: {dec['acceptance_batch']:.3f} as one batch,
  {dec['acceptance_single_mean']:.3f} mean over single-prompt runs.
"""
    text += """
`train_log.jsonl` is the loss log (every 10 steps); `train_summary.json`
holds all of the numbers above.
"""
    path = folder / "README.md"
    path.write_text(text)
    return path


def _flatten(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    defaults = TrainConfig(out="")
    p = argparse.ArgumentParser(prog="python -m mtplx_ext.train", description=__doc__.split("\n\n")[0])
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
    if cfg.freeze_trunk and not cfg.init:
        p.error("--freeze-trunk 1 needs --init MODEL_DIR (a trained trunk)")
    if cfg.minutes <= 0 and cfg.max_steps <= 0:
        p.error("give --minutes > 0 or --max-steps > 0")
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    summary = train(cfg)
    print(json.dumps({k: summary[k] for k in ("steps", "train_s", "heldout")}, indent=2))


if __name__ == "__main__":
    main()
