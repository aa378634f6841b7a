"""Self-distillation data: the trunk's own greedy continuations of training text.

A greedy draft is accepted when it equals the trunk's argmax, and at decode
time the head reads the trunk's hidden states over text the trunk itself
wrote. Teacher-forced training on the corpus shows the head human-written
text instead, whose continuations the trunk often would not have chosen.
Training the head on windows of the trunk's own greedy output (prompted with
windows of the *training* files, never the held-out ones) aims it at the
contexts and targets decoding meets: on that text every next token is the
trunk's argmax, so the data's token and the trunk's distribution agree. This
is the usual recipe for drafters (regenerate the data with the target).

The continuations are made with the package's own plain batched decoding
(greedy, no drafts), so they are exactly the tokens a greedy decode commits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mtplx_ext.batching import generate_greedy_batched


def prompt_windows(
    tokens: np.ndarray, eos: int, n: int, length: int, rng: np.random.Generator
) -> list[list[int]]:
    """`n` windows of `length` tokens at random offsets of `tokens` that hold no EOS.

    Raises:
        ValueError: `n` or `length` below 1, or no such window exists.
    """
    if n < 1 or length < 1:
        raise ValueError(f"prompt_windows needs n >= 1 and length >= 1, got n={n}, length={length}")
    if len(tokens) <= length:
        raise ValueError(f"{len(tokens)} tokens cannot give prompts of {length}")
    # A start is valid when no EOS lies in [s, s + length): a cumulative count.
    is_eos = np.concatenate([[0], np.cumsum(tokens == eos)])
    starts = np.arange(len(tokens) - length + 1)
    valid = starts[is_eos[starts + length] == is_eos[starts]]
    if len(valid) == 0:
        raise ValueError(f"no window of {length} tokens without an end-of-text token")
    picked = rng.choice(valid, size=n, replace=len(valid) < n)
    return [[int(t) for t in tokens[s : s + length]] for s in picked]


def greedy_stream(
    rt: Any,
    tokens: np.ndarray,
    eos: int,
    windows: int,
    prompt_len: int,
    new_tokens: int,
    rng: np.random.Generator,
    batch: int = 64,
) -> np.ndarray:
    """Prompt + the trunk's greedy continuation + EOS, for `windows` prompts, as one int32 stream.

    A continuation ends early where the trunk writes EOS (which is kept once).
    The stream is shaped like `encode_files`' output, so the training loop
    samples windows from it exactly as from the corpus.

    Args:
        rt: the runtime whose trunk writes the text (its head is not used).
        tokens: the training token stream the prompts are cut from.
        eos: the end-of-text token id.
        windows: how many continuations.
        prompt_len, new_tokens: tokens of each prompt and of each continuation.
        rng: draws the prompts' offsets.
        batch: prompts decoded together.
    """
    if new_tokens < 1 or batch < 1:
        raise ValueError(f"greedy_stream needs new_tokens >= 1 and batch >= 1, got {new_tokens}, {batch}")
    prompts = prompt_windows(tokens, eos, windows, prompt_len, rng)
    out: list[np.ndarray] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        res = generate_greedy_batched(
            rt, chunk, max_new_tokens=new_tokens, use_mtp_draft=False, stop_token_ids=(eos,)
        )
        for prompt, stream in zip(chunk, res.streams):
            text = [t for t in stream.tokens if t != eos]
            out.append(np.asarray(prompt + text + [eos], dtype=np.int32))
    return np.concatenate(out)


__all__ = ["greedy_stream", "prompt_windows"]
