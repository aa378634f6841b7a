"""logprobs / top_logprobs and logit_bias through `mtplx-ext serve` (MTP on; in this process: tests/_serve.py),
with the official openai client.

Logprobs must equal the float64 log-softmax of the shipped model's logits at
each committed position (one full trunk forward over the prompt, as the
server tokenizes it, plus the tokens read back from the reported bytes);
streamed logprobs must equal the non-streamed ones; a +100 bias forces its
token and -100 bans the tokens an unbiased reply used, greedy and sampled;
bad fields get a 400 naming them.
"""

from __future__ import annotations

import httpx
import mlx.core as mx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

import mtplx_ext  # noqa: E402
from mtplx_ext.serve import load_chat_tokenizer, params  # noqa: E402
from mtplx_ext.shipped import SHIPPED_MODEL  # noqa: E402
from _live_server import wait_idle  # noqa: E402
from _serve import LiveServer  # noqa: E402
from test_serve import KEY, _client  # noqa: E402

MODEL = "tiny-qwen3-mtp"


@pytest.fixture(scope="module")
def server():
    with LiveServer("--api-key", KEY, "--max-batch", "4", "--depth", "2") as s:
        yield s.base


@pytest.fixture(scope="module")
def shipped():
    return mtplx_ext.load(SHIPPED_MODEL)


def _ids_from_bytes(tok, raw: list[int]) -> int:
    """The token id whose byte-level spelling is these bytes."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    enc = {b: c for c, b in _byte_decoder().items()}
    tid = tok.token_to_id("".join(enc[b] for b in raw))
    assert tid is not None, raw
    return tid


def _reference(rt, prompt: list[int], tokens: list[int]) -> np.ndarray:
    logits = np.array(rt.trunk(mx.array([prompt + tokens]))[0].astype(mx.float32), np.float64)
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    m = rows.max(axis=-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


def _chat_prompt(rt, messages) -> list[int]:
    """The prompt ids the server builds for these messages (its own function, the folder's template)."""
    return params.chat_prompt({"messages": messages}, rt.tokenizer, load_chat_tokenizer(SHIPPED_MODEL))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chat_logprobs_equal_the_log_softmax_of_the_models_logits(server, shipped, temperature):
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    r = _client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=temperature, seed=7, logprobs=True, top_logprobs=4
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 16
    tok = shipped.tokenizer
    ids = [_ids_from_bytes(tok, c.bytes) for c in content]
    assert tok.decode(ids) == r.choices[0].message.content
    wait_idle(server, KEY)  # the server's engine (this process's) has taken its last step before this forward
    ref = _reference(shipped, _chat_prompt(shipped, messages), ids)
    for t, c in enumerate(content):
        assert abs(c.logprob - ref[t, ids[t]]) <= 2e-4 * (1 + abs(ref[t, ids[t]])), t
        assert len(c.top_logprobs) == 4
        best = np.sort(ref[t])[::-1][:4]
        for j, a in enumerate(c.top_logprobs):
            aid = _ids_from_bytes(tok, a.bytes)
            assert abs(a.logprob - ref[t, aid]) <= 2e-4 * (1 + abs(a.logprob))
            assert abs(a.logprob - best[j]) <= 1e-4 * (1 + abs(best[j]))
    assert r.model_extra["mtp"]["accepted_drafts"] > 0  # accepted drafts' logprobs were among those checked


def test_streamed_chat_logprobs_equal_the_non_streamed_ones(server):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "import os"}], max_tokens=12, temperature=0,
              logprobs=True, top_logprobs=2)
    c = _client(server)
    whole = c.chat.completions.create(**kw).choices[0].logprobs.content
    parts = [e for ch in c.chat.completions.create(stream=True, **kw) for e in
             ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])]
    assert [(p.token, p.logprob, [a.logprob for a in p.top_logprobs]) for p in parts] == \
        [(w.token, w.logprob, [a.logprob for a in w.top_logprobs]) for w in whole]


def test_completion_logprobs_object(server, shipped):
    r = _client(server).completions.create(model=MODEL, prompt="class Stack:", max_tokens=10, temperature=0,
                                           logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert all(len(t) <= 3 and max(t.values()) <= 0 for t in lp.top_logprobs)
    # Greedy: the token taken is the most likely one.
    assert all(abs(lp.token_logprobs[i] - max(lp.top_logprobs[i].values())) < 1e-6 for i in range(10))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens_with_mtp(server, shipped, temperature):
    c = _client(server)
    tok = shipped.tokenizer
    forced = tok.encode(" return").ids[-1]
    r = c.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, temperature=temperature, seed=3,
                             logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 8) and r.usage.completion_tokens == 8
    free = c.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, temperature=temperature, seed=3,
                                logprobs=0)
    used = {_ids_from_bytes(tok, list(t.encode())) for t in free.choices[0].logprobs.tokens if t.isascii()}
    assert used
    banned = c.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, temperature=temperature, seed=3,
                                  logprobs=0, logit_bias={str(t): -100 for t in used})
    got = {_ids_from_bytes(tok, list(t.encode())) for t in banned.choices[0].logprobs.tokens if t.isascii()}
    assert banned.usage.completion_tokens == 8 and not got & used


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ],
)
def test_bad_logprobs_and_logit_bias_fields_get_400_naming_them(server, path, body, field):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + path, json=body, headers=h, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["type"] == "invalid_request_error"
