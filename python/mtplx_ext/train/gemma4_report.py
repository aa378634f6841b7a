"""README.md of the Gemma 4 pair's folders, written from their train_summary.json.

Every number comes from the summary the run wrote, so the README states what
that run measured: the reproducing command, data, steps, minutes, machine,
held-out losses and, for the assistant, draft agreement and decode acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtplx_ext.train.report import command_line

PROG = "python -m mtplx_ext.train.gemma4"


def _command(stage: str, cfg: dict, out: str) -> str:
    # Empty strings are the flags' defaults: left out, the command stays runnable.
    kept = {k: v for k, v in cfg.items() if v != "" or k == "out"}
    if "target" in kept:
        kept["target"] = "TARGET_DIR"
    return command_line(kept, out, prog=f"{PROG} {stage}")


def _machine(s: dict) -> str:
    m = s["machine"]
    return (f"{m['cpus']}-core {m['machine']} {m['system']} CPU (MLX {m['mlx']} CPU backend, BLAS: {m['blas']})")


def _data(s: dict) -> str:
    d, cfg = s["data"], s["config"]
    limited = f" (the first {cfg['max_files']} of each split only)" if cfg.get("max_files") else ""
    return f"""The Python {d['python']} standard library's own `.py` files (`mtplx_ext.train.corpus`: the
directories `test`, `tests`, `encodings`, `pydoc_data` and `site-packages`
excluded), distributed under the Python Software Foundation License. A file is
held out when `crc32(relative path) % 1000 < {cfg['heldout_per_mille']}`, the split the shipped
model used{limited}: {d['train_files']} training files ({d['train_tokens']:,} tokens), {d['heldout_files']}
held-out files ({d['heldout_tokens']:,} tokens). Tokenizer: the shipped model's byte-level BPE
(`tokenizer.json`, vocabulary 2048, end-of-text `<|endoftext|>`)."""


def _run(s: dict) -> str:
    cfg = s["config"]
    ema = ", ".join(f"{k} {v:.3f}" for k, v in s["final_train_ema"].items() if v is not None)
    return f"""AdamW (weight decay 0.01), peak learning rate {cfg['lr']}, {cfg['warmup']} warmup steps then
cosine decay to 10 %, gradient clipping 1.0, batch {cfg['batch']} x {cfg['seq_len']} tokens, seed {cfg['seed']}.

- Steps: {s['steps']} ({s['train_tokens_seen']:,} training tokens seen), {s['train_s'] / 60:.1f} min of training,
  {s['total_s'] / 60:.1f} min in all, on a {_machine(s)}.
- Final training losses (moving average): {ema}."""


def write_target_readme(folder: str | Path) -> Path:
    """README.md of a target folder written by `gemma4.train_target`."""
    folder = Path(folder)
    s = json.loads((folder / "train_summary.json").read_text())
    cfg, held = s["config"], s["heldout"]
    types = s["layer_types"]
    text = f"""# {folder.name}: a tiny `gemma4_text` target

Trained by `mtplx_ext.train.gemma4 target` as the target of a small Gemma 4
pair (its assistant is trained against it, frozen). It writes
Python-looking code; it is a test and benchmark model, not a useful one.

- mlx-lm `gemma4_text`: hidden {cfg['hidden']}, {cfg['layers']} layers ({', '.join(t.split('_')[0] for t in types)}),
  {cfg['heads']} query heads, {cfg['kv_heads']} K/V head(s), head size {cfg['head_dim']} (sliding) /
  {cfg['global_head_dim']} (full), MLP {cfg['intermediate']}, sliding window {cfg['sliding_window']} tokens, the last
  {cfg['kv_shared']} layers reusing the K/V of the last earlier layer of their type, tied embeddings,
  final logit soft-capping {cfg['softcap']}, no per-layer inputs.
- {s['params'] / 1e6:.2f}M parameters, float32.

## Data

{_data(s)}

## Training

Next-token cross-entropy. {_run(s)}

    {_command('target', cfg, 'TARGET_DIR')}

- Held-out ({held['windows']} windows of {cfg['seq_len']} tokens): cross-entropy {held['target_ce']:.3f},
  top-1 accuracy {held['target_top1']:.3f}.

`train_log.jsonl` is the loss log (every 10 steps); `train_summary.json` holds
all of the numbers above.
"""
    path = folder / "README.md"
    path.write_text(text)
    return path


def write_assistant_readme(folder: str | Path) -> Path:
    """README.md of an assistant folder written by `gemma4.train_assistant` (the pair's README)."""
    folder = Path(folder)
    s = json.loads((folder / "train_summary.json").read_text())
    cfg, held = s["config"], s["heldout"]
    dec = held.get("decode", {})
    lam = cfg["distill"]
    agree = ", ".join(f"step {k.split('_')[1]}: {v:.3f}" for k, v in held.items() if k.startswith("agree_"))
    text = f"""# {folder.name}: a `gemma4_assistant` drafter for a tiny `gemma4_text` target

Trained by `mtplx_ext.train.gemma4 assistant` against its target, frozen. Load
the pair with `mtplx_ext.load(TARGET_DIR, drafter=ASSISTANT_DIR)` (`--drafter` on
`mtplx-ext generate`, `bench` and `serve`).

- Assistant: {len(cfg['types'].split(','))} layers ({cfg['types']}) with queries only over the
  target's K/V, hidden {cfg['hidden']}, {cfg['heads']} query heads, MLP {cfg['intermediate']},
  pre_projection 2 x {s['target']['config']['hidden'] if s.get('target') else '?'} -> {cfg['hidden']}, tied embedding LM head,
  post_projection back to the target's width; {s['params'] / 1e6:.2f}M parameters, float32.
- Target: see its own README (sliding window {s['sliding_window']} tokens){_target_line(s)}.

## Data

{_data(s)}

## Training

Every position of a window at once: the frozen target runs over x_0 .. x_(T-1)
and gives its final-normed hidden states, logits and the K/V of its source
layers; draft step 1 at position p reads (target embedding of x_p, hidden at
p - 1) and attends over the target's K/V of positions < p (sliding layers: the
last window + 1 of them) at RoPE position p, exactly the engine's draft step;
step k reads step k - 1's projected state and x_(p+k-1) at the same position.
Steps 1..{cfg['depth']} are trained, each towards {lam:g} x the target's distribution for its token
+ {1 - lam:g} x the data's token (drafts are accepted when they match the target), averaged.
{_run(s)}

    {_command('assistant', cfg, 'ASSISTANT_DIR')}

- Held-out ({held['windows']} windows of {cfg['seq_len']} tokens): step-1 cross-entropy against the
  data {held['step1_ce']:.3f}, against the target's distribution {held['step1_soft_ce']:.3f}.
- Greedy agreement with the target's argmax on held-out text (teacher-forced:
  the data's tokens fed): {agree}.
"""
    if dec:
        past = ("longer than" if dec["prompt_tokens"] > s["sliding_window"] else "not longer than") + " the window"
        text += f"""- Greedy MTP decoding of {dec['prompts']} held-out prompts (the first {dec['prompt_tokens']} tokens of
  held-out files, {past}) as one batch, {dec['new_tokens']} new tokens each:
"""
        for key in sorted(k for k in dec if k.startswith("depth_")):
            d = dec[key]
            per = "/".join(f"{x:.2f}" for x in d["acceptance_per_depth"])
            text += (f"  depth {key.split('_')[1]}: acceptance by draft position {per}, mean accepted drafts per cycle "
                     f"{d['mean_accepted_length']:.2f}, streams equal to plain greedy decoding "
                     f"{d['same_tokens_as_plain']}/{dec['prompts']}.\n")
    text += """
`train_log.jsonl` is the loss log (every 10 steps); `train_summary.json` holds
all of the numbers above and the target's own summary.
"""
    path = folder / "README.md"
    path.write_text(text)
    return path


def _target_line(s: dict) -> str:
    t = s.get("target")
    if not t:
        return ""
    h = t["heldout"]
    return (f"; {t['config']['layers']} layers, hidden {t['config']['hidden']}, {t['steps']} steps in "
            f"{t['train_s'] / 60:.1f} min, held-out cross-entropy {h['target_ce']:.3f}")


__all__ = ["write_assistant_readme", "write_target_readme"]
