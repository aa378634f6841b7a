"""Constrained requests in the continuous-batching Engine (`batching.constrained`).

Requests with a JSON-schema constraint, arriving at random steps among
unconstrained ones, commit exactly the tokens of decoding each prompt alone
(`generate_batched` with the same constraint; greedy and seeded sampled,
MTP at depth 2 and plain); unconstrained neighbours are unaffected.
"""

from __future__ import annotations

import numpy as np
import pytest
from _engine import drive
import _seed

pytest.importorskip("llguidance")

import mtplx_ext  # noqa: E402
from mtplx_ext import SamplerConfig  # noqa: E402
from mtplx_ext.batching import Engine  # noqa: E402
from mtplx_ext.decode.constraint import GrammarVocab  # noqa: E402
from mtplx_ext.shipped import BENCH_PROMPTS, SHIPPED_MODEL, eos_ids  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["name", "size", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def shipped():
    rt = mtplx_ext.load(SHIPPED_MODEL)
    eos = list(eos_ids(rt.tokenizer))
    return rt, GrammarVocab(rt.tokenizer, rt.vocab_size, eos), eos


@pytest.mark.parametrize("depth,mtp", [(2, True), (1, False)])
def test_constrained_and_free_requests_arriving_at_random_steps_decode_as_alone(shipped, depth, mtp):
    rt, gv, eos = shipped
    rng = _seed.rng()
    kws = []
    for i in range(6):
        cfg = SamplerConfig(temperature=0.0) if i % 2 else SamplerConfig(temperature=float(rng.uniform(0.6, 1.2)), top_k=20)
        kws.append(dict(prompt=rt.tokenizer.encode(str(rng.choice(BENCH_PROMPTS))).ids, max_tokens=int(rng.integers(8, 40)),
                        sampler=cfg, seed=int(rng.integers(1 << 40)), stop_token_ids=eos, constrained=i % 3 != 2))
    alone = []
    for kw in kws:
        r = mtplx_ext.generate_batched(rt, [kw["prompt"]], max_new_tokens=kw["max_tokens"], sampler=kw["sampler"],
                                       row_seeds=[kw["seed"]], depth=depth, use_mtp_draft=mtp, stop_token_ids=eos,
                                       constraints=[gv.json_schema(SCHEMA) if kw["constrained"] else None])
        alone.append(r.streams[0].tokens)
    eng = Engine(rt, max_batch=3, depth=depth, use_mtp=mtp, prefill_chunk=8)
    arrivals = []
    for kw in kws:
        args = {k: v for k, v in kw.items() if k != "constrained"}
        args["constraint"] = gv.json_schema(SCHEMA) if kw["constrained"] else None
        arrivals.append((int(rng.integers(0, 20)), args))
    got = drive(eng, arrivals)
    for i, (r, want) in enumerate(zip(got, alone)):
        assert r.error is None, r.error
        assert r.tokens == want, f"request {i} (constrained={kws[i]['constrained']})"
    if mtp:
        assert eng.metrics()["mean_accepted_length"] > 0.3


def test_submit_refuses_something_that_is_not_a_constraint(shipped):
    rt, _, _ = shipped
    eng = Engine(rt, max_batch=2, depth=1)
    with pytest.raises(TypeError, match="constraint"):
        eng.submit([1, 2, 3], constraint={"type": "object"})
