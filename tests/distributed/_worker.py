"""One rank of a distributed test run: `python _worker.py SPEC.json OUT_PREFIX` (rank and peers from MLX_*).

SPEC: {"timeout", "jobs": [{"name", "folder", "parallel", "head", "task":
"generate" | "engine", ...}]}: each job loads its folder split across the
ranks and decodes; the rank writes OUT_PREFIX.<rank>.json with what each job
computed, so the test compares every rank with one process. Starting the
ranks costs more than the jobs (imports), so one run does them all.
"""

from __future__ import annotations

import json
import sys

import mtplx_ext  # noqa: F401  (first: the fast BLAS before mlx.core)
import mlx.core as mx
from mlx.utils import tree_flatten

from mtplx_ext import EngineOptions, SamplerConfig, generate_batched
from mtplx_ext.batching.collective import Agreement, DistributedError, Watchdog
from mtplx_ext.batching.lockstep import LockstepEngine


def _generate(rt, spec: dict, group, dog: Watchdog) -> list:
    out = []
    for case in spec["cases"]:
        agree = Agreement(group, every=3)

        def hook(i, new):
            dog.beat()
            agree.update(i, new)

        sampler = SamplerConfig(**case["sampler"]) if case.get("sampler") else SamplerConfig(temperature=0.0)
        r = generate_batched(rt, case["prompts"], max_new_tokens=case["max_new"], sampler=sampler,
                             seed=case.get("seed", 0), depth=max(case["depth"], 1), use_mtp_draft=case["depth"] > 0,
                             on_commit=hook)
        agree.check()
        out.append({"tokens": [s.tokens for s in r.streams], "checks": agree.checks})
    return out


def _engine(rt, spec: dict, group, dog: Watchdog) -> list:
    options = EngineOptions(max_batch=spec["max_batch"], depth=spec["depth"], use_mtp=spec["depth"] > 0)
    eng = LockstepEngine(rt, group, options, watchdog=dog, tokenizer=None)
    if group.rank() != 0:
        eng.follow()
        return []
    arrivals = spec["requests"]
    reqs = {}
    step = 0
    with eng.session():
        while len(reqs) < len(arrivals) or not all(r.done for r in reqs.values()):
            for i, a in enumerate(arrivals):
                if a["step"] == step and i not in reqs:
                    sampler = SamplerConfig(**a["sampler"]) if a.get("sampler") else None
                    reqs[i] = eng.submit(a["prompt"], max_tokens=a["max_tokens"], sampler=sampler, seed=a["seed"])
            eng.step()
            step += 1
            if step > 10_000:
                raise RuntimeError("engine did not finish")
        eng.request_stop()
        eng.step()
    return [reqs[i].tokens for i in range(len(arrivals))]


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    group = mx.distributed.init()
    dog = Watchdog(spec.get("timeout", 60), group.rank())
    results = {}
    for job in spec["jobs"]:
        folder = job["folder"] if isinstance(job["folder"], str) else job["folder"][group.rank()]
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()  # the previous job's model is still alive
        rt = mtplx_ext.load(folder, group=group, parallel=job["parallel"], head=job.get("head"),
                          fuse_cpu_ops=job.get("fuse", False), kv_bits=job.get("kv_bits"),
                          kv_group_size=job.get("kv_group_size", 64))
        load_peak = mx.get_peak_memory() - before
        dog.beat()
        nbytes = sum(v.nbytes for _, v in tree_flatten(rt.parameters()))
        try:
            result = (_generate if job["task"] == "generate" else _engine)(rt, job, group, dog)
        except DistributedError as e:  # recorded: a test makes the ranks diverge on purpose
            result = {"error": str(e)}
        results[job["name"]] = {"param_bytes": nbytes, "load_peak_bytes": load_peak, "result": result,
                                "packed": bool(rt.linears_packed)}
        with open(f"{sys.argv[2]}.{group.rank()}.json", "w") as f:
            json.dump({"rank": group.rank(), "size": group.size(), "jobs": results}, f)
    dog.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
