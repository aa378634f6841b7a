"""The reasoning splitter, marker detection and the reasoning gate, without a server.

The splitter is checked against an independent one-shot oracle (partition
at the first end marker) at every chunk boundary, exhaustively for two cuts
and with hypothesis for any chunking of generated replies; a splitter that
loses one character at a chunk boundary is rejected by the same check. The
gate is checked against a fresh gate fed the same prefix (rollback), against
its masks, and with a real grammar (llguidance) behind it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

import _seed
from mtplx_ext.decode.constraint import mask_words
from mtplx_ext.decode.reasoning_gate import ReasoningGate
from mtplx_ext.serve import BadRequest
from mtplx_ext.serve.reasoning import (
    Markers,
    ReasoningSplitter,
    anthropic_options,
    detect,
    opens_reasoning,
    openai_options,
    split,
)
from mtplx_ext.shipped import SHIPPED_MODEL

THINK = Markers("<think>", "</think>")


def oracle(text: str, opened: bool, m: Markers = THINK) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply, written apart from the splitter: partition at the first end marker."""
    if not opened:
        lead = text.lstrip()
        if not lead.startswith(m.start):
            return "", text
        text = lead[len(m.start):]
    reasoning, sep, answer = text.partition(m.end)
    return reasoning.strip(), answer.lstrip() if sep else ""


def chunked(cls: type, text: str, opened: bool, cuts: list[int], m: Markers = THINK) -> tuple[str, str]:
    s = cls(m, opened)
    pieces, prev = [], 0
    for c in [*cuts, len(text)]:
        pieces += s.push(text[prev:c])
        prev = c
    pieces += s.finish()
    assert all(p for _, p in pieces), "an empty piece"
    return "".join(p for k, p in pieces if k == "reasoning"), "".join(p for k, p in pieces if k == "text")


class DropsAtBoundary(ReasoningSplitter):
    """Broken on purpose: loses the first character of every chunk after the first."""

    def __init__(self, markers: Markers | None, in_reasoning: bool = False):
        super().__init__(markers, in_reasoning)
        self.calls = 0

    def push(self, text: str) -> list[tuple[str, str]]:
        self.calls += 1
        return super().push(text[1:] if self.calls > 1 else text)


REPLIES = [
    ("<think>\nFirst a < b, then </th is not the end.\n</think>\n\nThe answer: <b>42</b>\n", False),
    ("  \n<think>plan</think>answer", False),
    ("I reason straight away </think  and on\n</think>\n\n  answer  ", True),
    ("the reasoning is cut off by max_tokens </thi", True),
    ("code\n<think>not reasoning</think>", False),
    ("<thi", False),
    ("   ", False),
    ("é😀<think>ü</think>ß", False),
]


def two_cut_mismatch(cls: type, text: str, opened: bool) -> tuple[int, int] | None:
    want = oracle(text, opened)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            if chunked(cls, text, opened, [i, j]) != want:
                return i, j
    return None


@pytest.mark.parametrize("text, opened", REPLIES)
def test_every_two_cut_chunking_splits_as_the_oracle(text, opened):
    assert split(THINK, text, opened) == oracle(text, opened)
    assert two_cut_mismatch(ReasoningSplitter, text, opened) is None


def test_a_splitter_that_drops_a_character_at_a_boundary_is_caught():
    assert all(two_cut_mismatch(DropsAtBoundary, t, o) is not None for t, o in REPLIES if len(t.strip()) > 1)


ALPHABET = ["<", "/", "t", "h", "i", "n", "k", ">", " ", "\n", "a", "é", "</think>", "<think>", "</th", "<th"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.sampled_from(ALPHABET), max_size=14), opened=st.booleans(), data=st.data())
def test_any_chunking_of_any_reply_splits_as_the_oracle(parts, opened, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    assert chunked(ReasoningSplitter, text, opened, cuts) == oracle(text, opened)


def test_random_replies_with_other_markers_split_at_single_character_chunks():
    rng = _seed.rng()
    m = Markers("[THINK]", "[/THINK]")
    for _ in range(40):
        words = ["[THINK]", "[/THINK]", "[/TH", "x", " ", "\n", "[", "ü"]
        text = "".join(rng.choice(words, int(rng.integers(0, 10))))
        opened = bool(rng.integers(2))
        assert chunked(ReasoningSplitter, text, opened, list(range(len(text))), m) == oracle(text, opened, m)


def test_without_markers_everything_is_text():
    s = ReasoningSplitter(None)
    assert s.push("<think>a</think> b ") + s.finish() == [("text", "<think>a</think> b ")]


def test_the_prompt_opens_the_reasoning_when_its_last_start_marker_is_unclosed():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not opens_reasoning("<think>old</think> user: hi\nassistant:", THINK)
    assert not opens_reasoning("<think>\n", None)
    # A marker in the user's own text is not the template's: only the prompt after the last message counts.
    user = "what does <think> do?"
    prompt = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    assert opens_reasoning(prompt, THINK) and not opens_reasoning(prompt, THINK, user)
    assert opens_reasoning(prompt + "<think>\n", THINK, user)
    assert opens_reasoning(prompt + "<think>\n", THINK, "a text the template rewrote")


# -- detection ----------------------------------------------------------------------


class _Tok:
    def __init__(self, vocab: dict[str, int], template: str = ""):
        self.vocab, self.chat_template = vocab, template

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_markers_come_from_the_vocabulary_the_template_or_the_setting(tmp_path):
    assert detect(_Tok({"<think>": 5, "</think>": 6})) == THINK
    assert detect(_Tok({"<seed:think>": 1, "</seed:think>": 2})) == Markers("<seed:think>", "</seed:think>")
    assert detect(_Tok({}, "{{ '<think>' }}...{{ '</think>' }}")) == THINK
    assert detect(_Tok({"<think>": 5})) is None  # one marker is not a pair
    assert detect(_Tok({}, "{{ messages }}")) is None
    assert detect(_Tok({"<think>": 5, "</think>": 6}), setting="none") is None
    assert detect(None, setting="<r>,</r>") == Markers("<r>", "</r>")
    with pytest.raises(ValueError, match="START,END"):
        detect(None, setting="<r>")
    # mlx-lm's wrapper over a tokenizer whose vocabulary holds the markers (as Qwen3's and DeepSeek-R1's do).
    from mtplx_ext.serve import load_chat_tokenizer

    tok = Tokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((SHIPPED_MODEL / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert detect(load_chat_tokenizer(tmp_path)) == THINK
    assert detect(load_chat_tokenizer(SHIPPED_MODEL)) is None  # the shipped code model does not reason


def test_request_fields_map_to_template_kwargs_and_budgets():
    th = openai_options({"reasoning_effort": "low"})
    assert th.template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"} and th.budget == 1024
    assert openai_options({"reasoning_effort": "high"}).budget is None
    assert openai_options({"reasoning_effort": "none"}).template_kwargs["enable_thinking"] is False
    th = openai_options({"enable_thinking": True, "thinking_token_budget": 7, "chat_template_kwargs": {"x": [1]}})
    assert th.template_kwargs == {"enable_thinking": True, "x": [1]} and th.budget == 7
    assert openai_options({"chat_template_kwargs": {"enable_thinking": False}}).budget == 0
    assert openai_options({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}).budget == 0
    assert openai_options({"reasoning_effort": "none", "enable_thinking": True}).budget is None
    th = anthropic_options({"thinking": {"type": "enabled", "budget_tokens": 10}}, 64)
    assert th.template_kwargs == {"enable_thinking": True} and th.budget == 10
    assert anthropic_options({"thinking": {"type": "disabled"}}, 64).template_kwargs == {"enable_thinking": False}
    assert anthropic_options({"thinking": {"type": "adaptive"}}, 64).budget is None
    for body, field in (({"reasoning_effort": "max"}, "reasoning_effort"), ({"enable_thinking": 1}, "enable_thinking"),
                        ({"thinking_token_budget": 0}, "thinking_token_budget"),
                        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": [1]}, "chat_template_kwargs")):
        with pytest.raises(BadRequest) as e:
            openai_options(body)
        assert e.value.param == field
    for thinking, field in (({"type": "enabled"}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": 64}, "thinking.budget_tokens"),
                            ({"type": "on"}, "thinking")):
        with pytest.raises(BadRequest) as e:
            anthropic_options({"thinking": thinking}, 64)
        assert e.value.param == field


# -- the gate -----------------------------------------------------------------------

V = 40
PIECES = {t: chr(ord("a") + t % 26) for t in range(V)} | {30: "</", 31: "think", 32: ">", 33: "<think>", 34: "\n"}
END_IDS, START_IDS, STOP = (30, 31, 32), (33,), 39


class Digits:
    """A toy inner constraint: tokens 1..9, then the stop token ends it (a stand-in grammar with known masks)."""

    def __init__(self, seen: list[int] | None = None):
        self.seen = list(seen or [])

    def fork(self) -> "Digits":
        return Digits(self.seen)

    def advance(self, tokens):
        n = 0
        for t in tokens:
            if self.is_terminated() or not (1 <= t <= 9 or (t == STOP and self.seen)):
                break
            self.seen.append(int(t))
            n += 1
        return n

    def rollback(self, n):
        del self.seen[len(self.seen) - n:]

    def fill_mask(self, out):
        out[:] = 0
        for t in list(range(1, 10)) + ([STOP] if self.seen else []):
            out.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))

    def is_terminated(self):
        return bool(self.seen) and self.seen[-1] == STOP


def gate(inner=None, phase="reasoning", budget=None) -> ReasoningGate:
    return ReasoningGate(inner, PIECES.__getitem__, "<think>", START_IDS, "</think>", END_IDS, phase=phase,
                         budget=budget, stop_ids=(STOP,))


def allowed(g: ReasoningGate) -> set[int]:
    out = np.zeros(mask_words(V), np.int32)
    g.fill_mask(out)
    return {t for t in range(V) if (int(out.view(np.uint32)[t // 32]) >> (t % 32)) & 1}


def state(g: ReasoningGate):
    return g.phase, g.count, g.tail, g.forced, tuple(g.inner.seen) if g.inner is not None else None


def test_the_gate_passes_reasoning_forces_the_end_at_the_budget_then_hands_over():
    g = gate(Digits(), budget=3)
    assert STOP not in allowed(g) and len(allowed(g)) == V - 1  # the answer must come: no stop while reasoning
    assert g.advance([10, 11, 12]) == 3 and g.phase == "closing"
    assert allowed(g) == {30} and g.forced_tokens() == [30, 31, 32]
    assert g.advance([31]) == 0  # not the forced token
    assert g.advance([30, 31, 32]) == 3 and g.phase == "answer"
    assert allowed(g) == set(range(1, 10)) and g.advance([5, 20]) == 1
    assert g.advance([STOP]) == 1 and g.is_terminated()
    # A marker the model writes itself, in its own tokens, ends the reasoning within the budget.
    g = gate(Digits(), budget=50)
    assert g.advance([1, 30, 31, 32, 7]) == 5 and g.phase == "answer" and g.inner.seen == [7]
    # Before the reasoning, the grammar's tokens or the one-token start marker.
    g = gate(Digits(), phase="before")
    assert allowed(g) == set(range(1, 10)) | {33}
    assert g.advance([33, 2, 3]) == 3 and g.phase == "reasoning" and g.inner.seen == []
    g = gate(None, phase="before", budget=2)
    assert g.advance([34, 33, 1, 2]) == 4 and g.phase == "closing"
    assert gate(None, budget=0).phase == "closing"


def test_rollback_restores_the_state_a_fresh_gate_reaches_on_the_prefix():
    rng = _seed.rng()
    for _ in range(200):
        budget = int(rng.integers(0, 6)) if rng.integers(2) else None
        phase = str(rng.choice(["before", "reasoning"]))
        inner = Digits() if rng.integers(2) else None
        g, seq = gate(inner, phase, budget), []
        for _ in range(int(rng.integers(1, 6))):
            # Tokens a constrained decode could pick: an allowed one mostly, sometimes a refused one.
            want = [int(rng.choice(sorted(allowed(g)))) if allowed(g) else 0 for _ in range(int(rng.integers(1, 5)))]
            f = g.fork()
            n = g.advance(want)
            assert f.advance(want) == n and state(f) == state(g)  # a fork goes on alike
            seq += want[:n]
            k = int(rng.integers(0, len(seq) + 1))
            g.rollback(k)
            del seq[len(seq) - k:]
            fresh = gate(Digits() if inner is not None else None, phase, budget)
            assert fresh.advance(seq) == len(seq)
            assert state(g) == state(fresh)


def test_a_real_grammar_takes_over_after_the_forced_end():
    llguidance = pytest.importorskip("llguidance")  # noqa: F841
    from mtplx_ext.decode.constraint import GrammarVocab

    tok = Tokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json"))
    gv = GrammarVocab(tok, tok.get_vocab_size(), [0])
    g = ReasoningGate(gv.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"], "additionalProperties": False}),
                      lambda t: tok.decode([t]), "<think>", tok.encode("<think>").ids, "</think>",
                      tok.encode("</think>").ids, budget=4, stop_ids=[0])
    reasoning = tok.encode("x < y, so").ids[:4]
    assert g.advance(reasoning) == len(reasoning) and g.phase == "closing"
    assert g.advance(g.forced_tokens()) == len(tok.encode("</think>").ids) and g.phase == "answer"
    assert g.fork().advance(tok.encode('{"b": 1').ids) < len(tok.encode('{"b": 1').ids)  # not the schema's key
    answer = tok.encode('{"a": 12}').ids
    assert g.advance(answer) == len(answer) and g.advance([0]) == 1 and g.is_terminated()
