"""Per-token logprobs from the Engine, MTP on and off, greedy and sampled.

Each committed token's logprob (and its top alternatives) must equal the
log-softmax of the target's logits at that position, computed in float64 from
one full forward of the trunk over prompt + committed tokens (no caches): for
the prefill's token, accepted drafts and resampled / bonus tokens alike. A
request that does not ask gets none, and its tokens are those it decodes
alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _engine import drive

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine
from mtplx_ext.shipped import SHIPPED_MODEL
import _seed

V = 300


@pytest.fixture(scope="module")
def rt():
    return mtplx_ext.init_random("qwen3", seed=int(_seed.rng().integers(1 << 30)), vocab_size=V)


@pytest.fixture(scope="module")
def shipped():
    # A trained head: most drafts are accepted, so accepted drafts' logprobs are checked too.
    return mtplx_ext.load(SHIPPED_MODEL)


def reference_logprobs(rt, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens), V] float64 log-softmax of the trunk's logits at each generated position."""
    logits = np.array(rt.trunk(mx.array([prompt + tokens]))[0].astype(mx.float32), np.float64)
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    m = rows.max(axis=-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


def check_request(rt, r, top: int) -> int:
    """Asserts r's logprobs against the float64 reference; returns how many tokens were checked."""
    assert r.error is None
    assert len(r.token_logprobs) == len(r.tokens) > 0
    ref = reference_logprobs(rt, r.prompt, r.tokens)
    assert ref.shape[0] == len(r.tokens)
    for t, (tok, (lp, alts)) in enumerate(zip(r.tokens, r.token_logprobs)):
        assert abs(lp - ref[t, tok]) <= 2e-4 * (1 + abs(ref[t, tok])), (t, lp, ref[t, tok])
        assert len(alts) == top
        order = np.argsort(-ref[t], kind="stable")
        for j, (aid, alp) in enumerate(alts):
            assert abs(alp - ref[t, aid]) <= 2e-4 * (1 + abs(alp))
            # The j-th alternative is the j-th most likely, up to float32 near-ties.
            assert ref[t, aid] >= ref[t, order[j]] - 1e-4
    return len(r.tokens)


@pytest.mark.parametrize("model,mtp,depth", [("random", True, 2), ("shipped", True, 3), ("random", False, 1)])
def test_logprobs_equal_the_log_softmax_of_full_forwards(request, model, mtp, depth):
    rt = request.getfixturevalue("rt" if model == "random" else "shipped")
    V = rt.vocab_size
    rng = _seed.rng()
    eng = Engine(rt, max_batch=3, depth=depth, use_mtp=mtp, prefill_chunk=8)
    kws = []
    for i in range(5):
        cfg = SamplerConfig(temperature=0.0) if i % 2 == 0 else SamplerConfig(temperature=0.9, top_p=0.9)
        if i == 3:  # a penalty and a bias change the sampler, not the logprobs (raw log-softmax)
            cfg = SamplerConfig(temperature=0.8, presence_penalty=0.7, logit_bias={5: 4.0})
        kws.append(dict(prompt=rng.integers(0, V, size=int(rng.integers(2, 12))).tolist(),
                        max_tokens=int(rng.integers(3, 14)), sampler=cfg, seed=int(rng.integers(1 << 40)),
                        logprobs=[0, 3, 20, 5, None][i]))
    alone = mtplx_ext.generate_batched(rt, [kws[4]["prompt"]], max_new_tokens=kws[4]["max_tokens"],
                                       sampler=kws[4]["sampler"], row_seeds=[kws[4]["seed"]], depth=depth,
                                       use_mtp_draft=mtp).streams[0].tokens
    events: dict[int, list] = {i: [] for i in range(5)}
    for i, kw in enumerate(kws):
        kw["on_event"] = lambda ev, i=i: events[i].append(ev)
    reqs = drive(eng, [(int(rng.integers(0, 10)), kw) for kw in kws])
    checked = sum(check_request(rt, r, kw["logprobs"]) for r, kw in zip(reqs[:4], kws[:4]))
    assert checked >= 12
    for i, r in enumerate(reqs[:4]):
        streamed = [e for ev in events[i] if ev.kind == "tokens" for e in (ev.logprobs or [])]
        assert streamed == r.token_logprobs
    # Without asking: none, and the tokens it decodes alone.
    assert reqs[4].token_logprobs == [] and reqs[4].tokens == alone
    assert all(ev.logprobs is None for ev in events[4])
    if model == "shipped":
        assert sum(r.accepted for r in reqs[:4]) >= 5  # accepted drafts' logprobs were among those checked


def test_bad_logprobs_argument_is_refused_naming_it(rt):
    eng = Engine(rt, max_batch=1, depth=1)
    for bad in (-1, 21, 2.0, True, "3"):
        with pytest.raises(ValueError, match="logprobs"):
            eng.submit([1, 2], logprobs=bad)
