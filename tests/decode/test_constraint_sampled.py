"""Exactness of constrained sampled MTP decoding (G-tests).

On a random qwen3 model over an 8-token vocabulary whose tokens spell
strings of a, b, c, the first depth + 1 tokens of many independent streams
(one seed each, one batch) constrained by a grammar (`root ::= ("a" [bc]
"cc")+`, written so that no answer can end inside them; after "ab" only the
token "c" is allowed, so some drafts are forced) must follow the
masked target distribution: prod_i p(t_i | prefix) with p the model's
logits masked to the tokens the grammar allows after the prefix, then
temperature and top-k (so the mask must come before top-k). The same test
rejects a decode that masks only the draft distribution (the target
unmasked), one that also masks the draft distribution q although the
drafts were drawn from the unmasked head, and one that keeps the head's q
for drafts the grammar forced (drawn from a point mass).
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
from mtplx_ext.decode.constraint import GrammarConstraint, apply_bitmask, mask_words  # noqa: E402
from mtplx_ext.sampling import distribution_from_logits  # noqa: E402
from _stats import ALPHA_BROKEN, ALPHA_EXACT, g_test_pvalue  # noqa: E402

V = 8
TOKENS = [b"<eos>", b"a", b"b", b"c", b"ab", b"ba", b"ca", b"bb"]
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


_starts: dict = {}


def start(compiled) -> "llguidance.LLMatcher":
    """A bare llguidance matcher at the grammar's start, built once (copies of it are cheap, builds are not)."""
    key = id(compiled[0]), compiled[1]
    if key not in _starts:
        _starts[key] = llguidance.LLMatcher(*compiled, log_level=0)
    return _starts[key]


def allowed_after(compiled, prefix: list[int]) -> np.ndarray | None:
    """[V] bool of the tokens the grammar allows after `prefix` (None: the prefix itself is refused)."""
    m = start(compiled).deep_copy()
    for t in prefix:
        if not m.consume_token(int(t)):
            return None
    bits = np.zeros((1, mask_words(V)), np.int32)
    llguidance.numpy.fill_next_token_bitmask(m, bits)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:V].astype(bool)


def masked_joint(rt, compiled, prompt: list[int], n: int) -> np.ndarray:
    """P(t_1..t_n) under the masked target, float64, flat [V**n]."""
    joint = np.ones(1)
    prefixes: list[list[int]] = [[]]
    for _ in range(n):
        rows = np.array(rt.trunk(mx.array([prompt + p for p in prefixes]))[:, -1].astype(mx.float32), np.float64)
        step = np.zeros((len(prefixes), V))
        for i, p in enumerate(prefixes):
            ok = allowed_after(compiled, p)
            if ok is not None and joint[i] > 0:
                step[i] = distribution_from_logits(np.where(ok, rows[i], -np.inf), CFG, None)
        joint = (joint[:, None] * step).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(V)]
    return joint


def decode(rt, compiled, prompt, seeds, depth, mtp=True, stop=(0,)):
    first = GrammarConstraint(*compiled)
    res = mtplx_ext.generate_batched(
        rt, [prompt] * len(seeds), max_new_tokens=depth + 1, sampler=CFG, row_seeds=seeds, depth=depth,
        use_mtp_draft=mtp, stop_token_ids=list(stop),
        constraints=[first.fork() for _ in seeds],
    )
    seqs = np.array([s.tokens for s in res.streams])
    assert seqs.shape == (len(seeds), depth + 1)
    return np.ravel_multi_index(tuple(seqs.T), (V,) * (depth + 1)), res


def model_with_useful_head(rng, compiled, depth):
    # A random head that drafts allowed, accepted tokens often enough for
    # the accept test and the residual to matter.
    for _ in range(8):
        rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(1 << 30)), vocab_size=V)
        prompt = rng.integers(0, V, size=int(rng.integers(2, 6))).tolist()
        _, res = decode(rt, compiled, prompt, list(range(300)), depth)
        if res.acceptance_rate > 0.25:
            return rt, prompt
    return rt, prompt


@pytest.fixture
def rng() -> np.random.Generator:
    return _seed.rng()


@pytest.mark.parametrize("depth", [1, 2])
def test_constrained_mtp_sampling_follows_the_masked_target_distribution(rng, compiled, depth, monkeypatch):
    import mtplx_ext.batching.constrained as constrained

    rt, prompt = model_with_useful_head(rng, compiled, depth)
    seeds = (int(rng.integers(1 << 40)) + np.arange(N)).tolist()
    forced = []
    real = constrained.forced_drafts
    monkeypatch.setattr(constrained, "forced_drafts", lambda *a: forced.append(int(a[3].sum())) or real(*a))
    idx, res = decode(rt, compiled, prompt, seeds, depth)
    assert sum(forced) > 0, "no draft was forced: the grammar-forced path was not exercised"
    assert res.reached[depth - 1] > 0, "no cycle reached the last draft"
    expected = masked_joint(rt, compiled, prompt, depth + 1)
    p = g_test_pvalue(np.bincount(idx, minlength=V ** (depth + 1)), expected)
    assert p >= ALPHA_EXACT, f"constrained MTP sampling off the masked target: p = {p:.2e} (acc {res.acceptance_rate:.2f})"
    plain, _ = decode(rt, compiled, prompt, seeds, depth, mtp=False)
    p_plain = g_test_pvalue(np.bincount(plain, minlength=V ** (depth + 1)), expected)
    assert p_plain >= ALPHA_EXACT, f"constrained plain sampling off the masked target: p = {p_plain:.2e}"


def test_the_test_rejects_masking_only_the_draft_masking_q_as_well_or_a_forced_draft_with_the_heads_q(
        rng, compiled, monkeypatch):
    import mtplx_ext.batching.constrained as constrained
    import mtplx_ext.decode.policies as policies

    depth = 2
    rt, prompt = model_with_useful_head(rng, compiled, depth)
    seeds = (int(rng.integers(1 << 40)) + np.arange(N_BROKEN)).tolist()
    expected = masked_joint(rt, compiled, prompt, depth + 1)
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

    variants = [("only the draft", policies.SampledPolicy, "verify", only_the_draft),
                ("q masked too", policies.SampledPolicy, "verify", q_masked_too),
                ("forced with the head's q", constrained, "forced_drafts", heads_q)]
    for name, obj, attr, variant in variants:
        with monkeypatch.context() as m:
            m.setattr(obj, attr, variant)
            idx, _ = decode(rt, compiled, prompt, seeds, depth, stop=())
        p = g_test_pvalue(np.bincount(idx, minlength=V ** (depth + 1)), expected)
        assert p < ALPHA_BROKEN, f"the broken variant '{name}' passed: p = {p:.2e}"
