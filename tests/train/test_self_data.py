"""Self-distillation data: prompts cut from the corpus, continued by the trunk's own greedy decoding."""

from __future__ import annotations

import numpy as np
import pytest

import mtplx_ext
from mtplx_ext.decode.results import StreamResult
from mtplx_ext.train.self_data import greedy_stream, prompt_windows
from _greedy import check_stream, reference
from _ragged import fresh_seed

EOS = 0


def _corpus(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
    """Random tokens in 1..vocab-1 with EOS at random places (files of random length)."""
    tokens = rng.integers(1, vocab, size=n).astype(np.int32)
    tokens[rng.choice(n, size=n // 20, replace=False)] = EOS
    return tokens


def test_prompt_windows_are_slices_of_the_corpus_without_eos():
    rng = np.random.default_rng(fresh_seed())
    tokens = _corpus(rng, 50, 4000)
    prompts = prompt_windows(tokens, EOS, 200, 9, rng)
    text = tokens.tolist()
    for p in prompts:
        assert len(p) == 9 and EOS not in p
        starts = [s for s in range(len(text) - 8) if text[s : s + 9] == p]
        assert starts, "a prompt that is not a slice of the corpus"
    # Offsets are spread over the corpus, not one window repeated.
    assert len({tuple(p) for p in prompts}) > 150


def test_prompt_windows_refuse_what_cannot_be_cut():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="end-of-text"):
        prompt_windows(np.array([1, 2, EOS, 3, 4, EOS], np.int32), EOS, 2, 3, rng)
    with pytest.raises(ValueError, match="length"):
        prompt_windows(np.array([1, 2, 3], np.int32), EOS, 2, 0, rng)
    with pytest.raises(ValueError, match="prompts of 5"):
        prompt_windows(np.array([1, 2, 3], np.int32), EOS, 2, 5, rng)


def test_the_stream_is_each_prompt_then_mlx_lms_greedy_continuation_then_eos():
    rng = np.random.default_rng(fresh_seed())
    rt = mtplx_ext.init_random("qwen3", seed=fresh_seed(), vocab_size=64)
    tokens = _corpus(rng, 64, 3000)
    seed = fresh_seed()
    stream = greedy_stream(rt, tokens, EOS, windows=5, prompt_len=6, new_tokens=12,
                           rng=np.random.default_rng(seed), batch=2)
    prompts = prompt_windows(tokens, EOS, 5, 6, np.random.default_rng(seed))
    pieces = np.split(stream, np.flatnonzero(stream == EOS) + 1)[:-1]
    assert len(pieces) == 5
    for i, (prompt, piece) in enumerate(zip(prompts, pieces)):
        piece = piece.tolist()
        assert piece[:6] == prompt and piece[-1] == EOS
        # The continuation is the trunk's greedy text (mlx-lm as the oracle), cut at EOS.
        ref, gaps = reference(rt, prompt, 12)
        got = piece[6:-1]
        finished = len(got) < 12
        stream_i = StreamResult(got + [EOS] if finished else got, "stop" if finished else "length")
        check_stream(i, stream_i, ref, gaps, {EOS}, 12)
