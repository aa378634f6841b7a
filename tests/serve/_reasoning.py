"""What the reasoning tests of the chat / Messages routes (test_reasoning.py) and of the Responses route
(test_responses_reasoning.py) share: a Qwen3-style test template on the shipped tokenizer, a scripted engine
served with it, the shipped model served with it, and the random replies the scripted engine writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from _serve import AppThread, LiveServer, ScriptedEngine

from mtplx_ext.serve import API, load_chat_tokenizer
from mtplx_ext.shipped import SHIPPED_MODEL

#: A Qwen3-style template (written for these tests): history keeps `reasoning_content`; with enable_thinking
#: the prompt opens `<think>` (as Qwen3-2507 / DeepSeek-R1 do), with `free` the model opens it itself, else
#: the prompt closes an empty block; the other template variables are rendered for the tests to read.
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
    "{% if extra is defined %}[extra={{ extra | tojson }}]{% endif %}"
    "{% if enable_thinking %}<think>\n{% elif not free %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def think_folder(tmp: Path) -> Path:
    """The shipped tokenizer with `THINK_TEMPLATE`."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.json").write_bytes((SHIPPED_MODEL / "tokenizer.json").read_bytes())
    cfg = json.loads((SHIPPED_MODEL / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINK_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp


class RecordingEngine(ScriptedEngine):
    """A `ScriptedEngine` that also records each request's constraint (it decodes unconstrained)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.constraints: list = []

    def submit(self, prompt, **kw):
        self.constraints.append(kw.get("constraint"))
        return super().submit(prompt, **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return think_folder(tmp_path_factory.mktemp("think-model"))


@pytest.fixture(scope="module")
def scripted(folder):
    """(the app thread, its `RecordingEngine`), served with the reasoning template."""
    eng = RecordingEngine(Tokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json")))
    with AppThread.scripted(eng, folder) as a:
        yield a, eng


@pytest.fixture(scope="module")
def live(folder):
    """The shipped model served at depth 2, with the reasoning template."""
    with LiveServer("--max-batch", "2", "--depth", "2") as s:
        api = API(s.api.engine, "think", s.api.tokenizer, load_chat_tokenizer(folder), None, s.api.eos_ids)
        with AppThread(api) as a:
            yield a, s


def reply_text(rng) -> str:
    """Reasoning or answer text with '<', '/' and cut-short markers, which must come through as text."""
    words = ["x < y", " </th", "ink", "\n", " <b>", "think", " é", " /", "> ", "a"]
    return "".join(rng.choice(words, int(rng.integers(0, 9))))
