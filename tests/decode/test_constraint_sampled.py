"""Exactness of constrained sampled MTP decoding (G-tests).

On a random qwen3 model over an 8-token vocabulary whose tokens spell
strings of a, b, c, the first depth + 1 tokens of many independent streams
(one seed each, one batch) constrained by a grammar (`root ::= ("a" [bc]
"cc")+`, written so that no answer can end inside them) must follow the
masked target distribution: prod_i p(t_i | prefix) with p the model's
logits masked to the tokens the constraint allows after the prefix, then
temperature and top-k (so the mask must come before top-k).

Two constraints of that grammar: llguidance's own (`GrammarConstraint`),
whose mask allows only the forced text's canonical tokens where text is
forced (after "ab" only "cc", not "c"), so a forced draft is always the one
token its mask allows (p = 1 there, whatever its q); and `EveryTokenization`,
the same matcher with every tokenization of the grammar's text allowed
(after "ab" both "c" and "cc") and the forced text still drafted as
llguidance's tokens ("cc"). Only there does a forced draft's q matter:
drawn from a point mass, its q must be one-hot, and the head's q would
accept "cc" with probability min(1, p/q) instead of p.

The same test rejects a decode that masks only the draft distribution (the
target unmasked), one that also masks the draft distribution q although
the drafts were drawn from the unmasked head, and one that keeps the head's
q for drafts the constraint forced.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import _seed

llguidance = pytest.importorskip("llguidance")

import llguidance.numpy  # noqa: E402

import mtplx_ext  # noqa: E402
from mtplx_ext import SamplerConfig  # noqa: E402
from mtplx_ext.decode.cycle import forget_kept_steps  # noqa: E402
from mtplx_ext.decode.constraint import GrammarConstraint, apply_bitmask, mask_words  # noqa: E402
from mtplx_ext.sampling import distribution_from_logits  # noqa: E402
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue  # noqa: E402

V = 8
TOKENS = [b"<eos>", b"a", b"b", b"c", b"ab", b"ba", b"ca", b"cc"]
GRAMMAR = 'root ::= p p p p p+\np ::= "a" [bc] "cc"'  # GBNF (llguidance converts it)
CFG = SamplerConfig(temperature=2.5, top_k=3)
N = 5000
#: Streams per broken variant (each is rejected with p far below ALPHA_BROKEN at this size).
N_BROKEN = 2000


class _Tokens:
    """The 8-token vocabulary as llguidance's tokenizer protocol (token bytes, EOS, an encoder)."""

    eos_token_id, bos_token_id, special_token_ids, tokens = 0, None, [0], TOKENS

    def __call__(self, text: bytes | str) -> list[int]:
        return encode(text.decode() if isinstance(text, bytes) else text)


@pytest.fixture(scope="module")
def compiled():
    """(llguidance tokenizer, grammar): `GrammarConstraint`'s arguments."""
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens()), slices=[])
    return tokenizer, llguidance.grammar_from("gbnf", GRAMMAR)


def encode(text: str) -> list[int]:
    """Longest-match tokenization over TOKENS (the forced text's drafts)."""
    data, out, i = text.encode(), [], 0
    while i < len(data):
        for L in (2, 1):
            piece = data[i : i + L]
            if len(piece) == L and piece in TOKENS[1:]:
                out.append(TOKENS.index(piece))
                i += L
                break
        else:
            raise ValueError(text)
    return out


class EveryTokenization:
    """`GrammarConstraint` with a mask that allows every token the matcher consumes.

    llguidance's mask allows only the canonical tokens of text the grammar
    forces; this one allows every tokenization of the grammar's text (as a
    constraint may), while the forced text is still drafted as llguidance's
    tokens (`forced_tokens`): a forced draft then has other allowed tokens
    beside it. Masks are kept by consumed tokens (shared by forks).
    """

    def __init__(self, inner: GrammarConstraint, consumed: tuple = (), masks: dict | None = None):
        self.inner, self.consumed, self.masks = inner, list(consumed), {} if masks is None else masks

    def fork(self) -> "EveryTokenization":
        return EveryTokenization(self.inner.fork(), tuple(self.consumed), self.masks)

    def advance(self, tokens) -> int:
        n = self.inner.advance(tokens)
        self.consumed += [int(t) for t in tokens[:n]]
        return n

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)
        del self.consumed[len(self.consumed) - n:]

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def forced_tokens(self) -> list[int]:
        return self.inner.forced_tokens()

    def fill_mask(self, out: np.ndarray) -> None:
        key = tuple(self.consumed)
        if key not in self.masks:
            bits = np.zeros_like(out)
            for t in range(V):
                if not self.inner.is_terminated() and self.inner.advance([t]) == 1:
                    self.inner.rollback(1)
                    bits[t // 32] |= np.int32(1 << (t % 32))
            self.masks[key] = bits
        out[:] = self.masks[key]


def grammar(compiled, every: bool):
    """The grammar's constraint at its start (llguidance's masks, or `EveryTokenization`)."""
    c = GrammarConstraint(*compiled)
    return EveryTokenization(c) if every else c


_starts: dict = {}


def start(compiled) -> "llguidance.LLMatcher":
    """A bare llguidance matcher at the grammar's start, built once (copies of it are cheap, builds are not)."""
    key = id(compiled[0]), compiled[1]
    if key not in _starts:
        _starts[key] = llguidance.LLMatcher(*compiled, log_level=0)
    return _starts[key]


def consumes(compiled, tokens: list[int]) -> "llguidance.LLMatcher | None":
    """A bare matcher after `tokens` (None: the grammar refuses them)."""
    m = start(compiled).deep_copy()
    return m if all(m.consume_token(int(t)) for t in tokens) else None


def allowed_after(compiled, every: bool, prefix: list[int]) -> np.ndarray | None:
    """[V] bool of the tokens allowed after `prefix` (None: the prefix itself is refused), from bare matchers.

    llguidance's mask, or (`every`) each token the grammar accepts after the prefix.
    """
    m = consumes(compiled, prefix)
    if m is None:
        return None
    if every:
        return np.array([consumes(compiled, prefix + [t]) is not None for t in range(V)])
    bits = np.zeros((1, mask_words(V)), np.int32)
    llguidance.numpy.fill_next_token_bitmask(m, bits)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:V].astype(bool)


def masked_joint(rt, compiled, every: bool, prompt: list[int], n: int) -> np.ndarray:
    """P(t_1..t_n) under the masked target, float64, flat [V**n]."""
    joint = np.ones(1)
    prefixes: list[list[int]] = [[]]
    for _ in range(n):
        rows = np.array(rt.trunk(mx.array([prompt + p for p in prefixes]))[:, -1].astype(mx.float32), np.float64)
        step = np.zeros((len(prefixes), V))
        for i, p in enumerate(prefixes):
            ok = allowed_after(compiled, every, p)
            if ok is not None and joint[i] > 0:
                step[i] = distribution_from_logits(np.where(ok, rows[i], -np.inf), CFG, None)
        joint = (joint[:, None] * step).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(V)]
    return joint


def decode(rt, first, prompt, seeds, depth, mtp=True, stop=(0,)):
    res = mtplx_ext.generate_batched(
        rt, [prompt] * len(seeds), max_new_tokens=depth + 1, sampler=CFG, row_seeds=seeds, depth=depth,
        use_mtp_draft=mtp, stop_token_ids=list(stop),
        constraints=[first.fork() for _ in seeds],
    )
    seqs = np.array([s.tokens for s in res.streams])
    assert seqs.shape == (len(seeds), depth + 1)
    return np.ravel_multi_index(tuple(seqs.T), (V,) * (depth + 1)), res


def model_with_useful_head(rng, first, depth):
    # A random head that drafts allowed, accepted tokens often enough for
    # the accept test and the residual to matter.
    for _ in range(8):
        rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=V)
        prompt = rng.integers(0, V, size=int(rng.integers(2, 6))).tolist()
        _, res = decode(rt, first, prompt, list(range(300)), depth)
        if res.acceptance_rate > 0.25:
            return rt, prompt
    return rt, prompt


def test_forced_drafts_have_other_allowed_tokens_beside_them_only_with_every_tokenization(compiled):
    # The premise of the forced-draft checks: after "ab" the grammar forces
    # "cc..." and llguidance drafts it as the token "cc"; its own mask
    # allows only that token there, `EveryTokenization` allows "c" too.
    ab, cc = encode("ab"), encode("cc")
    for every, allowed in ((False, ["cc"]), (True, ["c", "cc"])):
        c, bits = grammar(compiled, every).fork(), np.zeros(mask_words(V), np.int32)
        assert c.advance(ab) == 1 and c.forced_tokens() == cc
        c.fill_mask(bits)
        assert [TOKENS[t].decode() for t in np.flatnonzero(bits[0] >> np.arange(V) & 1)] == allowed
        assert [TOKENS[t].decode() for t in np.flatnonzero(allowed_after(compiled, every, ab))] == allowed


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


@pytest.mark.parametrize("depth, every", [(1, False), (2, True)], ids=["1-llguidance", "2-every-tokenization"])
def test_constrained_mtp_sampling_follows_the_masked_target_distribution(rng, compiled, depth, every, monkeypatch):
    import mtplx_ext.batching.constrained as constrained

    first = grammar(compiled, every)
    rt, prompt = model_with_useful_head(rng, first, depth)
    seeds = (int(rng.integers(1 << 40)) + np.arange(N)).tolist()
    forced = []
    real = constrained.forced_drafts
    monkeypatch.setattr(constrained, "forced_drafts", lambda *a: forced.append(int(a[3].sum())) or real(*a))
    idx, res = decode(rt, first, prompt, seeds, depth)
    assert sum(forced) > 0, "no draft was forced: the grammar-forced path was not exercised"
    assert res.reached[depth - 1] > 0, "no cycle reached the last draft"
    expected = masked_joint(rt, compiled, every, prompt, depth + 1)
    p = g_test_pvalue(np.bincount(idx, minlength=V ** (depth + 1)), expected)
    assert p >= ALPHA_EXACT, f"constrained MTP sampling off the masked target: p = {p:.2e} (acc {res.acceptance_rate:.2f})"
    plain, _ = decode(rt, first, prompt, seeds, depth, mtp=False)
    p_plain = g_test_pvalue(np.bincount(plain, minlength=V ** (depth + 1)), expected)
    assert p_plain >= ALPHA_EXACT, f"constrained plain sampling off the masked target: p = {p_plain:.2e}"


def test_the_test_rejects_masking_only_the_draft_masking_q_as_well_or_a_forced_draft_with_the_heads_q(
        rng, compiled, monkeypatch):
    import mtplx_ext.batching.constrained as constrained
    import mtplx_ext.decode.policies as policies

    depth = 2
    # Forced drafts beside other allowed tokens (with llguidance's own masks
    # a forced draft is the only token allowed, and its q cannot matter).
    every = True
    first = grammar(compiled, every)
    rt, prompt = model_with_useful_head(rng, first, depth)
    seeds = (int(rng.integers(1 << 40)) + np.arange(N_BROKEN)).tolist()
    expected = masked_joint(rt, compiled, every, prompt, depth + 1)
    real_verify = policies.SampledPolicy.verify

    def only_the_draft(self, logits, tokens, q, step=0):  # q masked, the target p left unmasked
        T = logits.shape[1]
        mask, self.mask = self.mask, None
        try:
            return real_verify(self, logits, tokens, apply_bitmask(q, mask[:, :T - 1]), step)
        finally:
            self.mask = mask

    def q_masked_too(self, logits, tokens, q, step=0):  # drafts drawn from the unmasked head
        return real_verify(self, logits, tokens, apply_bitmask(q, self.mask[:, : logits.shape[1] - 1]), step)

    def heads_q(tokens, info, new_tokens, forced):  # forced drafts put in, their q left as the head's
        return mx.array(new_tokens.astype(np.int32)), info

    # A verify variant is traced into compiled steps, and a decode that rebinds
    # steps kept from an earlier decode of the same runtime would run the
    # earlier rule again: each variant's decode forgets them first (checked below).
    variants = [("forced with the head's q", constrained, "forced_drafts", heads_q),
                ("only the draft", policies.SampledPolicy, "verify", only_the_draft),
                ("q masked too", policies.SampledPolicy, "verify", q_masked_too)]
    runs = []
    for name, obj, attr, variant in variants:
        forget_kept_steps(rt)  # (a fixed batch keeps its traced steps for the next one of its shapes)
        with monkeypatch.context() as m:
            m.setattr(obj, attr, variant)
            idx, _ = decode(rt, first, prompt, seeds, depth, stop=())
        assert not any(np.array_equal(idx, r) for r in runs), f"'{name}' decoded as an earlier variant: it did not run"
        runs.append(idx)
        p = g_test_pvalue(np.bincount(idx, minlength=V ** (depth + 1)), expected)
        assert p < ALPHA_BROKEN, f"the broken variant '{name}' passed: p = {p:.2e}"
