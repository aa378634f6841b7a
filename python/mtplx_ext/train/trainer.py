"""Training: the joint trunk + MTP head objective, evaluation, and the training run.

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

import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from mtplx_ext import _blas
from mtplx_ext.checkpoints import add_mtp_modules, init_random, load
from mtplx_ext.shipped import EOS_TOKEN
from mtplx_ext.train.corpus import encode_files, split_files, stdlib_files, stdlib_root, train_tokenizer
from mtplx_ext.train.loop import lr_at, run_loop, sample_windows
from mtplx_ext.train.self_data import greedy_stream
from mtplx_ext.train.report import write_model_readme

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
    #: Share of each batch's windows cut from the trunk's own greedy
    #: continuations of training text (`self_data.greedy_stream`) instead of
    #: the corpus; needs --init (a trained trunk).
    self_distill: float = 0.0
    #: Continuations made for it, and each one's prompt and new tokens.
    self_windows: int = 2048
    self_prompt: int = 48
    self_new: int = 208


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
    rt = init_random(
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


def file_start_prompts(tokens: np.ndarray, eos: int, n: int, length: int) -> list[list[int]]:
    """Up to `n` prompts: the first `length` tokens of each file in an EOS-separated stream
    (files shorter than that are skipped), in stream order."""
    prompts = []
    for s in [0] + [int(i) + 1 for i in np.flatnonzero(tokens == eos)[:-1]]:
        window = tokens[s : s + length]
        if len(window) == length and eos not in window:
            prompts.append([int(t) for t in window])
        if len(prompts) == n:
            break
    return prompts


def heldout_decode_acceptance(rt, held_tokens: np.ndarray, eos: int, n_prompts: int = 8,
                              prompt_len: int = 32, new_tokens: int = 96, depth: int = 1) -> dict:
    """Greedy MTP decoding from the starts of held-out files: the real acceptance rate.

    Depth 1 as one batch and per prompt; with `depth` > 1 also the batch
    decoded at that depth (acceptance per draft position, mean accepted length).
    """
    from mtplx_ext.batching import generate_greedy_batched

    prompts = file_start_prompts(held_tokens, eos, n_prompts, prompt_len)
    res = generate_greedy_batched(rt, prompts, max_new_tokens=new_tokens, depth=1)
    single = [generate_greedy_batched(rt, [p], max_new_tokens=new_tokens, depth=1).acceptance_rate for p in prompts]
    out = {
        "prompts": len(prompts),
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "acceptance_batch": res.acceptance_rate,
        "acceptance_single_mean": float(np.mean(single)),
    }
    if depth > 1:
        deep = generate_greedy_batched(rt, prompts, max_new_tokens=new_tokens, depth=depth)
        out[f"depth_{depth}"] = {
            "acceptance_per_depth": deep.acceptance_per_depth,
            "mean_accepted_length": deep.mean_accepted_length,
        }
    return out


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
    start = load(cfg.init, fuse_cpu_ops=False) if cfg.init else None
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
    n_params = sum(v.size for _, v in tree_flatten(rt.parameters()))
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    self_tokens = None
    if cfg.self_distill > 0.0:
        t = time.time()
        self_tokens = greedy_stream(rt, train_tokens, tok.token_to_id(EOS_TOKEN), cfg.self_windows,
                                    cfg.self_prompt, cfg.self_new, np.random.default_rng(cfg.seed + 1))
        print(f"self-distillation: {len(self_tokens):,} tokens of the trunk's greedy text "
              f"({time.time() - t:.0f}s)", flush=True)
    n_self = round(cfg.batch * cfg.self_distill)

    def sample() -> mx.array:
        """A batch: `n_self` windows of the trunk's own text, the rest from the corpus."""
        parts = []
        if n_self < cfg.batch:
            parts.append(sample_windows(rng, train_tokens, cfg.batch - n_self, cfg.seq_len + 1))
        if n_self:
            parts.append(sample_windows(rng, self_tokens, n_self, cfg.seq_len + 1))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=0.01)
    loss_and_grad = nn.value_and_grad(rt, lambda s: joint_loss(rt, s, cfg.head_weight, cfg.distill, cfg.depth, not cfg.freeze_trunk))
    state = [rt.state, opt.state, mx.random.state]

    def _step(seq):
        (loss, parts), grads = loss_and_grad(seq)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(rt, grads)
        return loss, parts[0], parts[1]

    step_fn = mx.compile(_step, inputs=state, outputs=state)

    def run_step(seq):
        res = step_fn(seq)
        mx.eval(state, res)
        return res

    log_path = out / "train_log.jsonl"
    log = log_path.open("w")
    done = run_loop(cfg, opt, run_step, sample, ("loss", "trunk_ce", "head_ce"), log)
    total, train_s = done.steps, done.train_s

    heldout = evaluate(rt, held_tokens, cfg.seq_len, cfg.eval_tokens, depth=max(cfg.depth, 3))
    heldout["decode"] = heldout_decode_acceptance(rt, held_tokens, tok.token_to_id(EOS_TOKEN), depth=cfg.depth)
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
        "self_distill_tokens": 0 if self_tokens is None else int(len(self_tokens)),
        "heldout_tokens": int(len(held_tokens)),
        "final_train_ema": done.ema,
        "heldout": heldout,
        "train_s": round(train_s, 1),
        "total_s": round(time.time() - t_start, 1),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "blas": _blas.describe(),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_model_readme(out)
    return summary
