"""Token constraints (grammars) as part of the target distribution, with MTP kept on.

A constrained stream's target distribution at every verified position is
the model's logits with the tokens the constraint forbids set to -inf
*before* the sampler's transforms (penalties, temperature, top-k/p, min-p),
given the constraint's state after the committed prefix plus x0 and the
drafts d_1..d_j the position sees. Drafts stay proposals from the unmasked
head: q is the distribution they were actually sampled from, so the
acceptance rule min(1, p/q) and the residual max(p - q, 0) keep the
committed tokens distributed as masked-p (a forbidden draft has p = 0 and
is always rejected), and greedy constrained MTP commits exactly the tokens
plain constrained decoding commits.

Per cycle the host does the grammar work between the one blocking read
(bundle plus the next cycle's x0 and drafts, evaluated together) and the
next launch: each constrained row commits its accepted tokens, probes the
next x0 and drafts (advance, mask, roll back; drafts after a state whose
continuation the grammar forces become the forced text's tokens, with a
one-hot draft distribution) and writes a [K + 1, W] int32
bitmask (W = ceil(V / 32), bit t of word t // 32 allows token t); the
[B, K + 1, W] array is uploaded once and expanded on the device
(`apply_bitmask`). Rows without a constraint get all-ones words: their
logits pass through unchanged.

`Constraint` is the protocol; `GrammarConstraint` adapts xgrammar's
matcher (chosen for its mask time on large vocabularies, see
bench/RESULTS.md); `grammar_vocab` builds the per-tokenizer compiler once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import time

import mlx.core as mx
import numpy as np

from mtplx_ext.models import mlx_lm_internals

#: Bits per mask word.
WORD = 32


def mask_words(vocab: int) -> int:
    """Words of a bitmask over `vocab` tokens."""
    return (int(vocab) + WORD - 1) // WORD


class Constraint(Protocol):
    """A token-level constraint of one stream (a grammar matcher).

    Its state is the sequence of tokens it consumed; every method but
    `fork` changes or reads that state only.
    """

    def fork(self) -> "Constraint":
        """An independent copy in the same state."""

    def advance(self, tokens: Sequence[int]) -> int:
        """Consumes tokens in order up to the first one refused; returns how many it consumed."""

    def rollback(self, n: int) -> None:
        """Undoes the last n consumed tokens."""

    def fill_mask(self, out: np.ndarray) -> None:
        """Writes the allowed next tokens into `out` ([W] int32 bitmask)."""

    def is_terminated(self) -> bool:
        """True once the constraint accepted its end (a stop token)."""

    # Optional: `forced_tokens() -> list[int]`, the tokens of the text the
    # constraint forces next; `RowConstraints.probe` drafts them.


def apply_bitmask(logits: mx.array, bits: mx.array) -> mx.array:
    """logits [..., V] with the tokens whose bit is 0 in `bits` [..., W] set to -inf."""
    V = logits.shape[-1]
    shifts = mx.arange(WORD, dtype=mx.uint32)
    allowed = (bits.astype(mx.uint32)[..., None] >> shifts) & 1
    allowed = allowed.reshape(*bits.shape[:-1], bits.shape[-1] * WORD)[..., :V]
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-float("inf"), logits.dtype))


def _forced(c: Any, mask: np.ndarray) -> list[int]:
    """The tokens the constraint's state forces next (its forced text tokenized, or a mask's only token)."""
    ids = list(c.forced_tokens()) if hasattr(c, "forced_tokens") else []
    if not ids:
        f = _single_token(mask)
        ids = [f] if f is not None else []
    return ids


def _single_token(row: np.ndarray) -> int | None:
    """The one token a [W] bitmask allows, or None when it allows several (or none)."""
    words = np.flatnonzero(row)
    if words.size != 1:
        return None
    w = int(row[words[0]]) & 0xFFFFFFFF
    if w & (w - 1):
        return None
    return int(words[0]) * WORD + w.bit_length() - 1


def forced_drafts(
    tokens: mx.array, info: mx.array | None, new_tokens: np.ndarray, forced: np.ndarray
) -> tuple[mx.array, mx.array | None]:
    """The next step's (tokens, draft logits) with forced drafts put in (`RowConstraints.probe`).

    A forced draft's row of the draft logits becomes one-hot (0 at the
    token, -inf elsewhere): the distribution it was drawn from. Greedy
    batches carry no draft logits (None).
    """
    new = mx.array(new_tokens.astype(np.int32))
    if info is None:
        return new, None
    V = info.shape[-1]
    hot = mx.arange(V)[None, None, :] == new[:, 1:, None]
    one_hot = mx.where(hot, mx.array(0.0, info.dtype), mx.array(-float("inf"), info.dtype))
    return new, mx.where(mx.array(forced)[:, :, None], one_hot, info)


def _usable(row: np.ndarray) -> np.ndarray:
    # An empty mask (a terminated grammar) would make the row unusable for
    # the verification kernels; the position is past the stream's end, so
    # any token is as good as another there.
    if not row.any():
        row[:] = -1
    return row


class RowConstraints:
    """The per-row constraints of one batch and the masks of its next step.

    Args:
        constraints: one per row, None for an unconstrained row.
        vocab: the model's vocabulary size V.
        positions: verified positions per step (K + 1; 1 for plain decoding).
    """

    def __init__(self, constraints: Sequence[Constraint | None], vocab: int, positions: int):
        self.rows = list(constraints)
        self.vocab = int(vocab)
        self.positions = int(positions)
        self.words = mask_words(vocab)
        self._buf = np.full((len(self.rows), self.positions, self.words), -1, dtype=np.int32)
        self.mask_s = 0.0  # host time spent building masks (advance, mask, roll back)

    @property
    def any(self) -> bool:
        return any(c is not None for c in self.rows)

    def current(self) -> mx.array:
        """[B, T, W] masks whose position 0 is each row's current state (a prefill's or plain step's pick)."""
        t0 = time.perf_counter()
        self._buf[:] = -1
        for b, c in enumerate(self.rows):
            if c is not None and not c.is_terminated():
                c.fill_mask(self._buf[b, 0])
                _usable(self._buf[b, 0])
        self.mask_s += time.perf_counter() - t0
        return mx.array(self._buf)

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """Row `row` committed `tokens` (its constraint consumes them)."""
        c = self.rows[row]
        if c is not None and tokens and not c.is_terminated():
            c.advance([int(t) for t in tokens])

    def commit_bundle(self, b: np.ndarray, live: Sequence[bool]) -> None:
        """Each live row commits x0 and its accepted drafts from a chain bundle (`engine.bundle`)."""
        from mtplx_ext.decode import bundle as chain

        for i in range(b.shape[0]):
            if live[i] and self.rows[i] is not None:
                n = max(int(b[i, chain.COL_N]), 0)
                self.commit(i, [int(b[i, chain.COL_X0])] + [int(t) for t in b[i, chain.COL_TOKENS : chain.COL_TOKENS + n]])

    #: Replace drafts the grammar forces (off: the head's drafts only, for side-by-side runs).
    force_drafts = True

    def probe(
        self, tokens: np.ndarray, live: Sequence[bool] | None = None, force: bool | None = None
    ) -> tuple[mx.array, np.ndarray | None, np.ndarray | None]:
        """Masks for a step fed `tokens` [B, T] (x0, d_1..d_K): position j after tokens[:j + 1].

        With `force` (default `force_drafts`), drafts after a state whose
        continuation the grammar forces (JSON keys and punctuation mostly
        are) are replaced by the tokens of that forced text (the
        constraint's `forced_tokens`, or the one token a mask allows): they
        are then drawn from a point mass, so their rows of the draft
        distribution must become one-hot (`forced_drafts`); verification
        accepts or rejects them like any draft.

        Returns:
            ([B, T, W] masks, the tokens with forced drafts or None when
            none was forced, [B, T - 1] bool of the forced drafts or None).

        The constraint's state is unchanged afterwards. Positions after a
        token the constraint refuses allow everything: verification rejects
        that token (its p is 0), so later positions are never committed.
        """
        t0 = time.perf_counter()
        force = self.force_drafts if force is None else force
        self._buf[:] = -1
        toks, forced = tokens, None
        for b, c in enumerate(self.rows):
            if c is None or (live is not None and not live[b]) or c.is_terminated():
                continue
            consumed = span_end = 0
            for j in range(self.positions):
                if c.is_terminated() or c.advance([int(toks[b, j])]) != 1:
                    break
                consumed += 1
                if c.is_terminated():  # a stop token: the stream ends here
                    break
                c.fill_mask(self._buf[b, j])
                _usable(self._buf[b, j])
                if not force or j + 1 >= self.positions or j + 1 < span_end:
                    continue
                ids = _forced(c, self._buf[b, j])[: self.positions - 1 - j]
                span_end = j + 1 + len(ids)
                # Every forced position is marked, also where the head drew the
                # same token: the proposal there is the point mass, not q.
                for k, t in enumerate(ids):
                    if forced is None:
                        toks = np.array(tokens, copy=True)
                        forced = np.zeros((len(self.rows), self.positions - 1), bool)
                    toks[b, j + 1 + k], forced[b, j + k] = t, True
            c.rollback(consumed)
        self.mask_s += time.perf_counter() - t0
        return mx.array(self._buf), (toks if forced is not None else None), forced


class GrammarConstraint:
    """An xgrammar matcher as a `Constraint`.

    Args:
        compiled: an `xgrammar.CompiledGrammar` (from `GrammarVocab`).
        encode: text -> token ids (the tokenizer's), for `forced_tokens`.
        matcher: the `xgrammar.GrammarMatcher` to go on from (`fork`); None: a new one at the grammar's start.
    """

    def __init__(self, compiled: Any, encode: Any = None, *, matcher: Any = None):
        import xgrammar as xgr

        self._compiled = compiled
        self._m = matcher if matcher is not None else xgr.GrammarMatcher(compiled)
        self._encode = encode

    def fork(self) -> "GrammarConstraint":
        return GrammarConstraint(self._compiled, self._encode, matcher=self._m.fork())

    def forced_tokens(self) -> list[int]:
        """The tokenizer's tokens of the text the grammar forces next ([] without one or without `encode`)."""
        if self._encode is None or self._m.is_terminated():
            return []
        text = self._m.find_jump_forward_string()
        return list(self._encode(text)) if text else []

    def advance(self, tokens: Sequence[int]) -> int:
        n = 0
        for t in tokens:
            if self._m.is_terminated() or not self._m.accept_token(int(t)):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(int(n))

    def fill_mask(self, out: np.ndarray) -> None:
        self._m.fill_next_token_bitmask(out.reshape(1, -1))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class GrammarVocab:
    """One tokenizer's grammar compiler (built once per tokenizer, reused by every request).

    Args:
        tokenizer: a Hugging Face tokenizer, mlx-lm's wrapper of one or a
            `tokenizers.Tokenizer` (a runtime's).
        vocab_size: the model's vocabulary size (>= the tokenizer's; the
            extra ids are never allowed).
        stop_token_ids: the tokens that end a constrained answer (the
            tokenizer's EOS by default).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None):
        import xgrammar as xgr

        hf = mlx_lm_internals.hf_tokenizer(tokenizer)
        if not hasattr(hf, "backend_tokenizer"):  # a bare `tokenizers.Tokenizer` (a runtime's)
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=hf)
        stops = None if stop_token_ids is None else [int(t) for t in stop_token_ids]
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=int(vocab_size), stop_token_ids=stops)
        self.stop_token_ids = list(self.info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.vocab_size = int(vocab_size)
        self.encode = lambda text: hf.encode(text, add_special_tokens=False)

    def json_schema(self, schema: dict | str, strict: bool = True) -> GrammarConstraint:
        """A constraint to JSON that validates against `schema` (ValueError for a schema it cannot compile)."""
        import json

        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            compiled = self.compiler.compile_json_schema(text, strict_mode=bool(strict), any_whitespace=False)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad schemas
            raise ValueError(f"unusable JSON schema: {e}") from None
        return GrammarConstraint(compiled, encode=self.encode)

    def json_object(self) -> GrammarConstraint:
        """A constraint to any JSON object."""
        return self.json_schema({"type": "object"}, strict=False)

    def ebnf(self, grammar: str) -> GrammarConstraint:
        """A constraint to an EBNF grammar (xgrammar's GBNF dialect, root rule `root`)."""
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"unusable grammar: {e}") from None
        return GrammarConstraint(compiled, encode=self.encode)


__all__ = ["Constraint", "GrammarConstraint", "GrammarVocab", "RowConstraints", "apply_bitmask", "forced_drafts",
           "mask_words"]
