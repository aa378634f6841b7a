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

`Constraint` is the protocol; `GrammarConstraint` adapts llguidance's
matcher (chosen for its install, no torch or triton, with mask times far
below a decode step: bench/RESULTS.md); `GrammarVocab` builds the
per-tokenizer vocabulary once. llguidance is imported only when a
constraint is built, so the core install does not need it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

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


#: JSON layout of every JSON grammar: no free whitespace (a model could pad forever), OpenAI's separators;
#: `oneOf` read as `anyOf` (what a generator can enforce; the schemas clients send use it for alternatives).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}


def grammar_engine() -> str | None:
    """The installed grammar engine's version (llguidance), or None when it cannot be imported.

    Checked per use rather than once, so a server can say at any time
    whether structured outputs are available (the `serve` extra brings it).
    """
    try:
        import llguidance
    except ImportError:
        return None
    return str(getattr(llguidance, "__version__", "unknown"))


#: Keywords whose value is a map of names to subschemas (the names are not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: Keywords whose value is data, not a schema.
_DATA = ("const", "enum", "default", "examples", "required")


def strict_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not set it.

    OpenAI's `strict: true` semantics (only the listed properties); the JSON
    Schema default, which the grammar engine follows, allows any others.
    """
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: strict_schema(sub) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA else strict_schema(v)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarConstraint:
    """An llguidance matcher as a `Constraint`.

    Stop tokens are handled here, not by the matcher: llguidance accepts an
    end-of-text token once the grammar is complete but keeps no history of
    it, so `is_terminated` and `rollback` count it themselves. Tokens are
    consumed with `try_consume_tokens`, which refuses a token without
    putting the matcher into its (permanent) error state.

    Args:
        tokenizer: an `llguidance.LLTokenizer` (`GrammarVocab.tokenizer`).
        grammar: an llguidance grammar (`LLMatcher.grammar_from_*`).
        matcher: the `llguidance.LLMatcher` to go on from (`fork`); None: a new one at the grammar's start.
        ended: whether that matcher's stream already consumed a stop token.

    Raises:
        ValueError: the grammar does not compile (the engine's message).
    """

    def __init__(self, tokenizer: Any, grammar: str, *, matcher: Any = None, ended: bool = False):
        import llguidance

        self._tokenizer, self._grammar = tokenizer, grammar
        if matcher is None:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
        self._m = matcher
        self._stops = frozenset(int(t) for t in tokenizer.eos_tokens)
        self._ended = bool(ended)

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that end the constrained stream (allowed once the grammar is complete)."""
        return sorted(self._stops)

    def fork(self) -> "GrammarConstraint":
        return GrammarConstraint(self._tokenizer, self._grammar, matcher=self._m.deep_copy(), ended=self._ended)

    def forced_tokens(self) -> list[int]:
        """The tokens of the text the grammar forces next ([] where nothing is forced)."""
        if self._ended or self._m.is_stopped():
            return []
        return [int(t) for t in self._m.compute_ff_tokens()]

    def advance(self, tokens: Sequence[int]) -> int:
        n = 0
        for t in tokens:
            t = int(t)
            if self._ended:
                break
            if t in self._stops:
                if not self._m.is_accepting():
                    break
                self._ended = True
            elif self._m.try_consume_tokens([t]) != 1:
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        n = int(n)
        if n > 0 and self._ended:
            self._ended, n = False, n - 1
        if n > 0:
            self._m.rollback(n)

    def fill_mask(self, out: np.ndarray) -> None:
        if self._ended:
            out[:] = 0
            return
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask(self._m, out.reshape(1, -1))

    def is_terminated(self) -> bool:
        return self._ended


def tokenizer_json(tokenizer: Any) -> str:
    """The `tokenizers` JSON of a Hugging Face tokenizer, mlx-lm's wrapper of one or a `tokenizers.Tokenizer`."""
    import copy

    hf = mlx_lm_internals.hf_tokenizer(tokenizer)
    backend = copy.copy(getattr(hf, "backend_tokenizer", hf))
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class GrammarVocab:
    """One tokenizer's grammar vocabulary (built once per tokenizer, reused by every request).

    Args:
        tokenizer: a Hugging Face tokenizer, mlx-lm's wrapper of one or a
            `tokenizers.Tokenizer` (a runtime's).
        vocab_size: the model's vocabulary size (>= the tokenizer's; the
            extra ids are never allowed).
        stop_token_ids: the tokens that end a constrained answer (the
            tokenizer's EOS by default).

    Raises:
        ImportError: llguidance is not installed (the `serve` extra).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None):
        import llguidance

        stops = [int(t) for t in stop_token_ids] if stop_token_ids else None
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json(tokenizer), n_vocab=int(vocab_size), eos_token=stops)
        self.stop_token_ids = [int(t) for t in self.tokenizer.eos_tokens]
        self.vocab_size = int(vocab_size)
        # Grammars at their start, by grammar text: a client sends the same schema or tools again and again
        # (an agent's every turn), and building a matcher costs far more than forking one.
        self._starts: collections.OrderedDict[str, GrammarConstraint] = collections.OrderedDict()
        self._lock = threading.Lock()

    #: Grammars kept at their start (least recently used dropped first).
    CACHED = 64

    def grammar(self, grammar: str) -> GrammarConstraint:
        """A constraint to an llguidance grammar at its start (ValueError naming what is wrong with it)."""
        with self._lock:
            first = self._starts.get(grammar)
            if first is not None:
                self._starts.move_to_end(grammar)
                return first.fork()
        first = GrammarConstraint(self.tokenizer, grammar)  # ValueError with the engine's message
        with self._lock:
            self._starts[grammar] = first
            while len(self._starts) > self.CACHED:
                self._starts.popitem(last=False)
        return first.fork()

    def json_schema(self, schema: dict | str, strict: bool = True) -> GrammarConstraint:
        """A constraint to JSON that validates against `schema` (ValueError for a schema it cannot compile).

        `strict`: objects allow only the properties they list (`strict_schema`)
        and a keyword the engine does not implement (`uniqueItems`, `not`,
        ...) is a ValueError naming it; not strict, such keywords are ignored
        (best effort, as OpenAI's non-strict mode).
        """
        import json

        import llguidance

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"unusable JSON schema: {e}") from None
        if strict:
            schema = strict_schema(schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={**JSON_LAYOUT, "lenient": not strict})
            return self.grammar(grammar)
        except ValueError as e:
            raise ValueError(f"unusable JSON schema: {e}") from None

    def json_object(self) -> GrammarConstraint:
        """A constraint to any JSON object."""
        return self.json_schema({"type": "object"}, strict=False)

    def wrapped_json(self, prefix: str, schema: dict, suffix: str, strict: bool = True, lenient: bool = False
                     ) -> GrammarConstraint:
        """A constraint to `prefix`, JSON valid against `schema`, then `suffix` (a tool call in its markers).

        `strict` as in `json_schema`; `lenient`: keywords the engine does not
        implement are ignored rather than refused.
        """
        import json

        import llguidance

        body = {**(strict_schema(schema) if strict else schema), "x-guidance": {**JSON_LAYOUT, "lenient": lenient}}
        lark = (f"start: {json.dumps(prefix, ensure_ascii=False)} call {json.dumps(suffix, ensure_ascii=False)}\n"
                f"call: %json {json.dumps(body)}")
        try:
            return self.grammar(llguidance.LLMatcher.grammar_from_lark(lark))
        except ValueError as e:
            raise ValueError(f"unusable JSON schema: {e}") from None

    def ebnf(self, grammar: str) -> GrammarConstraint:
        """A constraint to a GBNF grammar (llama.cpp's dialect, root rule `root`) or a Lark one."""
        import llguidance

        try:
            return self.grammar(llguidance.grammar_from("gbnf", grammar))
        except ValueError as e:
            raise ValueError(f"unusable grammar: {e}") from None


__all__ = ["JSON_LAYOUT", "Constraint", "GrammarConstraint", "GrammarVocab", "RowConstraints", "apply_bitmask",
           "forced_drafts", "grammar_engine", "mask_words", "strict_schema", "tokenizer_json"]
