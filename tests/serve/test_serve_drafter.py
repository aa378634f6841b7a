"""`mtplx-ext serve --drafter`: a Gemma 4 target with its assistant behind the OpenAI API, end to end.

The trained pair under bench/models/tiny-gemma4-pair (a `gemma4_text` target
and its `gemma4_assistant`) is served on 127.0.0.1 with MTP at depth 2 (in
this process: tests/_serve.py; the CLI loads the pair from its flags).
Concurrent greedy requests, longer than the target's sliding window, must
each give the text that the offline engine gives for the same request alone,
the assistant's drafts must be accepted (the drafter really ran), and the
server must end with nothing left running.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import numpy as np
import pytest
from _live_server import wait_idle
from _serve import LiveServer
import _seed

openai = pytest.importorskip("openai")

import mtplx_ext  # noqa: E402
from mtplx_ext.batching import Engine  # noqa: E402
from mtplx_ext.benchmark import heldout_prompts  # noqa: E402
from mtplx_ext.shipped import eos_ids  # noqa: E402

PAIR = Path(__file__).resolve().parents[2] / "bench" / "models" / "tiny-gemma4-pair"
N_TOKENS = 24


@pytest.fixture(scope="module")
def pair():
    return mtplx_ext.load(PAIR / "target", drafter=PAIR / "assistant")


def _offline(rt, ids: list[int], n: int) -> str:
    eng = Engine(rt, max_batch=1, depth=2)
    r = eng.submit(ids, max_tokens=n, stop_token_ids=eos_ids(rt.tokenizer))
    eng.run_until_idle()
    return r.text


def test_greedy_requests_to_a_served_pair_equal_the_offline_engine_and_accept_drafts(pair):
    window = int(pair.trunk.args.sliding_window)
    seed = int(_seed.rng().integers(1 << 30))
    prompts = [pair.tokenizer.decode(p) for p in heldout_prompts(pair.tokenizer, 4, window + 16, seed=seed)]
    with LiveServer("--model", str(PAIR / "target"), "--drafter", str(PAIR / "assistant"),
                    "--depth", "2", "--max-batch", "4") as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=120, max_retries=0)

        def ask(text: str) -> str:
            r = client.completions.create(model="target", prompt=text, max_tokens=N_TOKENS, temperature=0)
            return r.choices[0].text

        with cf.ThreadPoolExecutor(4) as pool:
            served = list(pool.map(ask, prompts))
        m = wait_idle(server.base)
    for text, got in zip(prompts, served):
        ids = pair.tokenizer.encode(text).ids
        assert len(ids) > window
        assert got == _offline(pair, ids, N_TOKENS), text
    assert m["failed"] == 0 and m["live_streams"] == 0 and m["kv_slots"] == 0
    assert 0 < m["acceptance"] <= 1, m
