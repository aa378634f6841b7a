"""Tensor- and pipeline-parallel MTP decoding on 2 ranks (127.0.0.1, ring backend) against one process.

One 2-rank run (starting the ranks costs more than decoding) does every
job: small random models saved to folders, each rank loading its part
(`checkpoints.sharded.load`), decoded at depths 1-3 and plain, batches 1
and 3, greedy and sampled with seeds, and a `LockstepEngine` fed requests
at random steps. The oracle is this process: the unsharded runtime's
tokens, and a one-process `Engine` fed the same requests at the same
steps. Every rank must commit exactly those, and hold less than the whole
model. Prompts, seeds and arrival steps are fresh each run.
"""

from __future__ import annotations

import numpy as np
import pytest
from mlx.utils import tree_flatten

import mtplx_ext
from mtplx_ext import SamplerConfig
from mtplx_ext.batching import Engine

from _dist import run_worker
import _seed

pytestmark = pytest.mark.slow

#: (job name, family, parallel, head (None: the default, sharded in tensor parallel), sampled)
JOBS = [
    ("qwen3-tensor", "qwen3", "tensor", None, True),
    ("deepseek-tensor", "deepseek_v3", "tensor", "replicate", False),
    ("deepseek-pipeline", "deepseek_v3", "pipeline", "replicate", True),
    ("deepseek-tensor-head-sharded", "deepseek_v3", "tensor", "shard", False),  # named, as the default
]
#: Jobs whose ranks keep quantized KV (`load(kv_bits=...)`): each rank quantizes its own heads' rows,
#: which are the unsharded model's rows of those heads.
KV_JOBS = {"qwen3-tensor-kv8": 8}


def _cases(rng, vocab: int, sampled: bool) -> list[dict]:
    cases = []
    for batch in (1, 3):
        for depth in (0, 1, 2, 3):
            prompts = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(3, 9)))] for _ in range(batch)]
            cases.append({"prompts": prompts, "depth": depth, "max_new": 10})
    if sampled:
        for depth in (1, 3):
            prompts = [[int(t) for t in rng.integers(0, vocab, 6)] for _ in range(3)]
            cases.append({"prompts": prompts, "depth": depth, "max_new": 10, "seed": int(rng.integers(0, 2**31)),
                          "sampler": {"temperature": 0.9, "top_p": 0.95}})
    return cases


def _oracle(rt, cases: list[dict]) -> list[list[list[int]]]:
    out = []
    for c in cases:
        sampler = SamplerConfig(**c["sampler"]) if c.get("sampler") else SamplerConfig(temperature=0.0)
        r = mtplx_ext.generate_batched(rt, c["prompts"], max_new_tokens=c["max_new"], sampler=sampler,
                                       seed=c.get("seed", 0), depth=max(c["depth"], 1), use_mtp_draft=c["depth"] > 0)
        out.append([s.tokens for s in r.streams])
    return out


def _arrivals(rng, vocab: int) -> list[dict]:
    reqs = []
    for i in range(6):
        sampled = bool(rng.integers(0, 2))
        reqs.append({"step": int(rng.integers(0, 12)), "prompt": [int(t) for t in rng.integers(0, vocab, int(rng.integers(3, 10)))],
                     "max_tokens": int(rng.integers(4, 14)), "seed": int(rng.integers(0, 2**31)),
                     "sampler": {"temperature": 0.8} if sampled else None})
    return reqs


def _engine_oracle(rt, job: dict) -> list[list[int]]:
    eng = Engine(rt, max_batch=job["max_batch"], depth=job["depth"], use_mtp=job["depth"] > 0)
    reqs, step = {}, 0
    with eng.session():
        while len(reqs) < len(job["requests"]) or not all(r.done for r in reqs.values()):
            for i, a in enumerate(job["requests"]):
                if a["step"] == step:
                    sampler = SamplerConfig(**a["sampler"]) if a["sampler"] else None
                    reqs[i] = eng.submit(a["prompt"], max_tokens=a["max_tokens"], sampler=sampler, seed=a["seed"])
            eng.step()
            step += 1
    return [reqs[i].tokens for i in range(len(job["requests"]))]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rng = _seed.rng()
    tmp = tmp_path_factory.mktemp("dist")
    jobs, want, whole = [], {}, {}
    for name, family, parallel, head, sampled in JOBS + [(n, "qwen3", "tensor", None, True) for n in KV_JOBS]:
        kv = {"kv_bits": KV_JOBS[name], "kv_group_size": 32} if name in KV_JOBS else {}
        rt = mtplx_ext.init_random(family, seed=int(rng.integers(0, 2**31)), **({"head_dim": 32} if kv else {}))
        rt.save(tmp / name)
        if kv:
            rt.set_kv_quantization(kv["kv_bits"], kv["kv_group_size"])
        cases = _cases(rng, rt.vocab_size, sampled)
        want[name] = _oracle(rt, cases)
        whole[name] = sum(v.nbytes for _, v in tree_flatten(rt.parameters()))
        jobs.append({"name": name, "task": "generate", "folder": str(tmp / name), "parallel": parallel,
                     "head": head, "cases": cases, **kv})
    rt = mtplx_ext.init_random("qwen3", seed=int(rng.integers(0, 2**31)))
    rt.save(tmp / "engine")
    job = {"name": "engine", "task": "engine", "folder": str(tmp / "engine"), "parallel": "tensor",
           "max_batch": 3, "depth": 2, "requests": _arrivals(rng, rt.vocab_size)}
    want["engine"] = _engine_oracle(rt, job)
    whole["engine"] = sum(v.nbytes for _, v in tree_flatten(rt.parameters()))
    jobs.append(job)
    # The same on fused ranks: their tensor-parallel shards packed for the CPU GEMM.
    jobs.append({**job, "name": "engine_packed", "fuse": True})
    # The broken variant: rank 1 loads another model of the same shape (plain decoding, so both ranks
    # still run the same number of forwards); the agreement check must catch it.
    mtplx_ext.init_random("qwen3", seed=int(rng.integers(0, 2**31))).save(tmp / "other")
    jobs.append({"name": "diverge", "task": "generate", "folder": [str(tmp / "engine"), str(tmp / "other")],
                 "parallel": "tensor", "cases": [{"prompts": [[1, 2, 3, 4]] * 2, "depth": 0, "max_new": 12}]})
    _, outs = run_worker({"timeout": 60, "jobs": jobs}, tmp, timeout=150)
    return jobs, want, whole, outs


@pytest.mark.parametrize("name", [j[0] for j in JOBS] + list(KV_JOBS))
def test_two_ranks_commit_one_process_tokens(run, name):
    jobs, want, whole, outs = run
    cases = next(j for j in jobs if j["name"] == name)["cases"]
    for o in outs:
        assert o["size"] == 2
        got = o["jobs"][name]
        assert got["param_bytes"] < whole[name], f"rank {o['rank']} holds the whole model: not split"
        # Loading reads each full tensor to cut its slice: only one at a time may be alive, so a rank's
        # peak stays below the whole model (all of them at once peak at the whole model plus the share).
        assert got["load_peak_bytes"] < whole[name], (
            f"rank {o['rank']}: loading peaked at {got['load_peak_bytes']} bytes, the whole model is {whole[name]}")
        for c, g, exp in zip(cases, got["result"], want[name]):
            what = f"rank {o['rank']}, depth {c['depth']}, batch {len(c['prompts'])}, {'sampled' if c.get('sampler') else 'greedy'}"
            assert g["tokens"] == exp, what
            assert g["checks"] >= 1  # the ranks compared their commits


@pytest.mark.parametrize("name", ["engine", "engine_packed"])
def test_lockstep_engine_with_random_arrivals_equals_one_process(run, name):
    _, want, whole, outs = run
    assert outs[0]["jobs"][name]["result"] == want["engine"]
    assert all(len(t) > 0 for t in want["engine"])
    assert outs[1]["jobs"][name]["param_bytes"] < whole["engine"]
    assert all(o["jobs"][name]["packed"] == (name == "engine_packed") for o in outs)


def test_ranks_that_commit_different_tokens_are_caught(run):
    outs = run[3]
    for o in outs:
        assert "committed different tokens" in o["jobs"]["diverge"]["result"]["error"]


def test_the_comparison_can_fail(rng):
    """Another model's greedy tokens differ from the oracle's: equal tokens are not a given."""
    a = mtplx_ext.init_random("qwen3", seed=1)
    b = mtplx_ext.init_random("qwen3", seed=2)
    prompts = [[int(t) for t in rng.integers(0, a.vocab_size, 6)]]
    ta = mtplx_ext.generate_greedy_batched(a, prompts, max_new_tokens=12, depth=1).streams[0].tokens
    tb = mtplx_ext.generate_greedy_batched(b, prompts, max_new_tokens=12, depth=1).streams[0].tokens
    assert ta != tb
