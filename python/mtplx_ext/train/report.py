"""What a training run leaves beside its model: the command that reproduces it and the folder's README."""

from __future__ import annotations

import json
from pathlib import Path

def command_line(cfg: dict, out: str | None = None, prog: str = "python -m mtplx_ext.train") -> str:
    """The command (`prog` and one flag per field) that reproduces a run with config `cfg`."""
    parts = [prog, f"--out {out or cfg['out']}"]
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
    if float(cfg.get("self_distill", 0.0)) > 0:
        text += f"""- Self-distillation: {100 * float(cfg['self_distill']):g} % of each batch's windows were cut from the
  trunk's own greedy continuations ({cfg['self_new']} new tokens) of {cfg['self_windows']} windows of
  {cfg['self_prompt']} tokens of the training files ({s.get('self_distill_tokens', 0):,} tokens), the text a
  greedy decode feeds the head.
"""
    if dec:
        text += f"""- Greedy MTP decoding acceptance rate, prompts = the first {dec['prompt_tokens']} tokens of
  {dec['prompts']} held-out files, {dec['new_tokens']} new tokens each: {dec['acceptance_batch']:.3f} as one batch,
  {dec['acceptance_single_mean']:.3f} mean over single-prompt runs.
"""
        for key, deep in dec.items():
            if key.startswith("depth_"):
                per = " / ".join(f"{a:.3f}" for a in deep["acceptance_per_depth"])
                text += f"""- The same batch at depth {key.split('_')[1]}: acceptance per draft position {per},
  mean accepted length {deep['mean_accepted_length']:.3f}.
"""
    text += """
`train_log.jsonl` is the loss log (every 10 steps); `train_summary.json`
holds all of the numbers above.
"""
    path = folder / "README.md"
    path.write_text(text)
    return path
