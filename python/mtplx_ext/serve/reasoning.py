"""Reasoning models: their markers, the reasoning/answer split of a reply, and the request fields that steer them.

A reasoning model writes its reasoning between two markers before the
answer: `<think>` / `</think>` for Qwen3, DeepSeek-R1 and GLM-4.5 (others in
`KNOWN`). The server hands that text to clients apart from the answer
(OpenAI's `reasoning_content` as vLLM does, Anthropic's `thinking` blocks),
so the markers never land in `content`.

* `detect(chat_tokenizer, tokenizer, setting)` finds a model's `Markers`:
  mlx-lm's tokenizer wrapper names them when they are tokens of the
  vocabulary; else a `KNOWN` pair whose markers are both tokens or both in
  the chat template's text. `setting="none"` says the model does not reason.
* `ReasoningSplitter` splits a reply as it streams, wherever the
  detokenizer's chunks cut a marker; `split` does a whole reply the same
  way (streamed deltas always concatenate to it). Templates that open the
  reasoning in the prompt (Qwen3-2507 / DeepSeek-R1 with thinking on) make
  the reply start inside it: `opens_reasoning(prompt_text, markers)`.
* `openai_options` / `anthropic_options` read `reasoning_effort`,
  `enable_thinking`, `chat_template_kwargs`, `thinking_token_budget` and
  Anthropic's `thinking` into `Thinking`: the template's keyword arguments
  and a reasoning budget, enforced by `gate` (a `decode.reasoning_gate`
  constraint: forced end marker, then the request's grammar, if any).

Whitespace: the reasoning is stripped at both ends and the answer after a
reasoning block loses its leading whitespace (the newlines templates put
around the markers); a reply without a reasoning block is left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtplx_ext.serve.errors import BadRequest

#: (start, end) marker pairs of reasoning families, tried in order.
KNOWN = (("<think>", "</think>"), ("<seed:think>", "</seed:think>"), ("<longcat_think>", "</longcat_think>"),
         ("<|think:start|>", "<|think:end|>"), ("◁think▷", "◁/think▷"), ("[THINK]", "[/THINK]"))

#: OpenAI's `reasoning_effort` values -> reasoning budget in tokens (None: bounded by max_tokens only).
EFFORT_BUDGET: dict[str, int | None] = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None,
                                        "xhigh": None}

#: Template arguments the server sets itself (a request's `chat_template_kwargs` may not).
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "continue_final_message",
                             "return_dict", "chat_template", "conversation"})


@dataclass(frozen=True)
class Markers:
    """A model's reasoning markers: the text between `start` and `end` is reasoning."""

    start: str
    end: str


def _vocab(tok: Any) -> dict[str, int]:
    try:
        return dict(tok.get_vocab()) if tok is not None else {}
    except (AttributeError, TypeError):
        return {}


def _template_text(chat_tokenizer: Any) -> str:
    t = getattr(chat_tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    if isinstance(t, (list, tuple)):
        return "\n".join(str(x.get("template", "")) if isinstance(x, dict) else str(x) for x in t)
    return t if isinstance(t, str) else ""


def detect(chat_tokenizer: Any, tokenizer: Any = None, setting: Any = "auto") -> Markers | None:
    """The model's reasoning markers, or None when it does not reason.

    Args:
        chat_tokenizer: mlx-lm's tokenizer wrapper (or any object with
            `chat_template` / `get_vocab`), or None.
        tokenizer: the runtime's tokenizer (its vocabulary is searched too).
        setting: "auto" (detect), "none" (no reasoning), a `Markers`, or a
            (start, end) pair / a "START,END" string naming them.
    """
    if isinstance(setting, Markers):
        return setting
    if setting in (None, "none"):
        return None
    if isinstance(setting, str) and setting != "auto":
        start, sep, end = setting.partition(",")
        setting = (start, end) if sep else None
    if isinstance(setting, (tuple, list)):
        if len(setting) != 2 or not all(isinstance(s, str) and s for s in setting):
            raise ValueError(f"reasoning markers must be 'auto', 'none' or 'START,END', got {setting!r}")
        return Markers(setting[0], setting[1])
    if setting != "auto":
        raise ValueError(f"reasoning markers must be 'auto', 'none' or 'START,END', got {setting!r}")
    if getattr(chat_tokenizer, "has_thinking", False):
        start, end = getattr(chat_tokenizer, "think_start", None), getattr(chat_tokenizer, "think_end", None)
        if isinstance(start, str) and isinstance(end, str) and start and end:
            return Markers(start, end)
    vocab = {**_vocab(tokenizer), **_vocab(chat_tokenizer)}
    text = _template_text(chat_tokenizer)
    for start, end in KNOWN:
        if (start in vocab and end in vocab) or (start in text and end in text):
            return Markers(start, end)
    return None


def opens_reasoning(prompt_text: str, markers: Markers | None, last: str = "") -> bool:
    """Whether the prompt leaves a reasoning block open (the reply then starts inside it).

    `last` is the last message's text: only the prompt after it (the
    template's generation prompt) is read, so a marker a user wrote is not
    taken for the template's. Without it (or when the template changed it
    beyond recognition) the whole prompt is read.
    """
    if markers is None:
        return False
    last = last.strip()
    at = prompt_text.rfind(last) if last else -1
    if at >= 0:
        prompt_text = prompt_text[at + len(last):]
    s = prompt_text.rfind(markers.start)
    return s >= 0 and s > prompt_text.rfind(markers.end)


def _held(buf: str, marker: str) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of `marker` (it may still become one)."""
    return next((n for n in range(min(len(marker) - 1, len(buf)), 0, -1) if marker.startswith(buf[-n:])), 0)


class ReasoningSplitter:
    """Splits a reply into reasoning and answer text as it arrives.

    `push(text)` and `finish()` return pieces `("reasoning", str)` and
    `("text", str)`, in order; every character of the reply but the markers
    and the stripped whitespace (module docstring) comes out exactly once,
    however the reply is cut into chunks. Only the start of the reply may
    open a reasoning block (after whitespace); the first end marker closes
    it. What could still be a marker, or whitespace that may end the
    reasoning, is held back until it is known.

    Args:
        markers: the model's markers (None: every piece is text).
        in_reasoning: the prompt opened the reasoning (`opens_reasoning`).
    """

    def __init__(self, markers: Markers | None, in_reasoning: bool = False):
        self.markers = markers
        self.phase = "answer" if markers is None else ("reasoning" if in_reasoning else "before")
        self.buf = ""
        # Strip leading whitespace: nothing of the reasoning, or of the answer after it, has come out yet.
        self.lead = self.phase == "reasoning"
        self.reasoning = ""  # all the reasoning so far

    def _out(self, kind: str, s: str, out: list[tuple[str, str]]) -> None:
        if self.lead:
            s = s.lstrip()
        if s:
            self.lead = False
            if kind == "reasoning":
                self.reasoning += s
            out.append((kind, s))

    def push(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.buf += text
        m = self.markers
        if self.phase == "before":
            lead = self.buf.lstrip()
            if lead.startswith(m.start):
                self.phase, self.buf, self.lead = "reasoning", lead[len(m.start):], True
            elif not m.start.startswith(lead):
                self.phase, self.lead = "answer", False  # no reasoning block: the reply as it is
            else:
                return out
        if self.phase == "reasoning":
            k = self.buf.find(m.end)
            if k < 0:
                keep = _held(self.buf, m.end)
                body = self.buf[: len(self.buf) - keep]
                cut = len(body.rstrip())  # trailing whitespace waits: it may end the reasoning
                self._out("reasoning", self.buf[:cut], out)
                self.buf = self.buf[cut:]
                return out
            self._out("reasoning", self.buf[:k].rstrip(), out)
            self.phase, self.buf, self.lead = "answer", self.buf[k + len(m.end):], True
        if self.buf:
            self._out("text", self.buf, out)
            self.buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        rest, self.buf = self.buf, ""
        if self.phase == "reasoning":
            self._out("reasoning", rest.rstrip(), out)
        elif self.phase == "before":
            if rest:
                out.append(("text", rest))  # whitespace, or a start marker cut short: the reply's own text
        elif rest:
            self._out("text", rest, out)
        return out


def split(markers: Markers | None, text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """A whole reply's (reasoning, answer), as `ReasoningSplitter` streams them."""
    s = ReasoningSplitter(markers, in_reasoning)
    pieces = s.push(text) + s.finish()
    return "".join(p for k, p in pieces if k == "reasoning"), "".join(p for k, p in pieces if k == "text")


@dataclass
class Thinking:
    """What a request asks of the reasoning.

    Attributes:
        template_kwargs: extra keyword arguments of `apply_chat_template`.
        budget: most reasoning tokens (None: unbounded; 0: reasoning off).
        asked: the request asked for reasoning explicitly (a 400 on a model without markers).
        field: the request field that asked (for that 400).
    """

    template_kwargs: dict[str, Any] = field(default_factory=dict)
    budget: int | None = None
    asked: bool = False
    field: str = ""


def _template_kwargs(body: dict) -> dict[str, Any]:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
        raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    bad = sorted(set(kw) & RESERVED_KWARGS)
    if bad:
        raise BadRequest(f"chat_template_kwargs may not set {bad[0]!r} (the server sets it)", "chat_template_kwargs")
    return dict(kw)


def _positive(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise BadRequest(f"{name} must be an integer >= 1, got {v!r}", name)
    return v


def openai_options(body: dict) -> Thinking:
    """The chat body's `reasoning_effort`, `enable_thinking`, `thinking_token_budget`, `chat_template_kwargs`.

    `reasoning_effort` "none" turns thinking off (`enable_thinking=False`);
    the others turn it on with `EFFORT_BUDGET`'s budget; the value also
    reaches the template as `reasoning_effort` (templates such as gpt-oss's
    read it). `thinking_token_budget` (vLLM's field) sets the budget itself.
    `chat_template_kwargs` go to the template last, over the others.
    """
    th = Thinking()
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORT_BUDGET:
            raise BadRequest(f"reasoning_effort must be one of {', '.join(EFFORT_BUDGET)}, got {effort!r}",
                             "reasoning_effort")
        th.template_kwargs.update(enable_thinking=effort != "none", reasoning_effort=effort)
        th.budget = EFFORT_BUDGET[effort]
        th.asked, th.field = effort != "none", "reasoning_effort"
    on = body.get("enable_thinking")
    if on is not None:
        if not isinstance(on, bool):
            raise BadRequest("enable_thinking must be a boolean", "enable_thinking")
        th.template_kwargs["enable_thinking"] = on
    if body.get("thinking_token_budget") is not None:
        th.budget = _positive(body["thinking_token_budget"], "thinking_token_budget")
        th.asked, th.field = True, "thinking_token_budget"
    th.template_kwargs.update(_template_kwargs(body))
    on = th.template_kwargs.get("enable_thinking")
    if on is False:
        th.budget = 0  # thinking off wins over any budget
    elif on is True and th.budget == 0:
        th.budget = None  # an explicit enable_thinking over reasoning_effort "none"
    return th


def anthropic_options(body: dict, max_tokens: int) -> Thinking:
    """A Messages body's `thinking`: {"type": "enabled", "budget_tokens": N} (1 <= N < max_tokens), "adaptive"
    (thinking on, no budget) or "disabled"; absent leaves the template's default.

    Anthropic asks for at least 1024 budget tokens; smaller budgets are
    allowed here (small local models reason briefly).
    """
    th = Thinking(template_kwargs=_template_kwargs(body))
    t = body.get("thinking")
    if t is None:
        return th
    if not isinstance(t, dict) or t.get("type") not in ("enabled", "disabled", "adaptive"):
        raise BadRequest('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                         '{"type": "disabled"}', "thinking")
    if t["type"] == "disabled":
        th.template_kwargs.setdefault("enable_thinking", False)
        th.budget = 0
        return th
    th.template_kwargs.setdefault("enable_thinking", True)
    th.asked, th.field = True, "thinking"
    if t["type"] == "enabled":
        th.budget = _positive(t.get("budget_tokens"), "thinking.budget_tokens")
        if th.budget >= max_tokens:
            raise BadRequest(f"thinking.budget_tokens ({th.budget}) must be less than max_tokens ({max_tokens})",
                             "thinking.budget_tokens")
    return th


def check_model(markers: Markers | None, th: Thinking) -> None:
    """A request that asks for reasoning from a model without markers gets a 400 naming the field."""
    if markers is None and th.asked:
        raise BadRequest(f"{th.field}: this model does not reason (no reasoning markers; see "
                         "`mtplx-ext serve --reasoning-markers`)", th.field)


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        enc = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        enc = tokenizer.encode(text)
    return list(getattr(enc, "ids", enc))


def gate(api: Any, markers: Markers | None, inner: Any, th: Thinking, in_reasoning: bool) -> Any:
    """The request's constraint: `inner` (its grammar, or None) behind the reasoning, with its budget.

    Nothing changes without markers or without a budget or a grammar. With
    thinking off (`budget == 0`) the gate runs only when the prompt still
    opened the reasoning (a template without the switch): the end marker
    is then forced at once.
    """
    if markers is None or (inner is None and th.budget is None) or (th.budget == 0 and not in_reasoning):
        return inner
    from mtplx_ext.decode.reasoning_gate import ReasoningGate  # noqa: PLC0415

    tok = api.tokenizer
    return ReasoningGate(inner, lambda t: tok.decode([t]), markers.start, _encode(tok, markers.start), markers.end,
                         _encode(tok, markers.end), phase="reasoning" if in_reasoning else "before",
                         budget=th.budget, stop_ids=api.eos_ids)


__all__ = ["EFFORT_BUDGET", "KNOWN", "Markers", "ReasoningSplitter", "Thinking", "anthropic_options", "check_model",
           "detect", "gate", "opens_reasoning", "openai_options", "split"]
