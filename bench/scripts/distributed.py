"""One process against 2 ranks (tensor or pipeline parallel, ring backend on 127.0.0.1): tokens/s, rounds, memory.

Without MLX_RANK in its environment the script starts its own runs, one at
a time: the model in one process, then split over `--ranks` processes
(hostfile of free loopback ports, MLX_RANK per rank, as `mlx.launch
--backend ring` does on one host); each run writes JSON and the script
prints them side by side. Each run, on every rank:

* tokens/s of greedy decoding (compiled steps) at each batch size, plain and
  MTP at each depth, interleaved per repeat, medians; every prompt decodes at
  every batch size (`benchmark.prompt_groups`: batch 1 decodes each alone); the prompts are cut
  from the held-out stdlib files (`benchmark.heldout_prompts`, the same on
  every rank), or the bench's own openings with `--prompts 0`;
* collective rounds per cycle and per generated token: one eager decode
  with `mx.distributed`'s collectives counted as the graph is built (a
  batch's rows share a round);
* the latency of one decode-sized collective (an all_sum of [1, hidden]
  float32), median of 200;
* memory: MLX's peak and the process's peak RSS after loading and after
  decoding;
* with `--compare-head` (tensor parallel): the other head mode too (a
  second runtime on every rank, `--head shard` against `replicate` or the
  reverse), its MTP decodes interleaved with the first's in every repeat,
  so the two heads are compared within one run.

Then a paper model for M ranks over a link of latency `--link-us`: a step
of the memory-bound model costs compute / M + rounds * latency, from the
measured one-process step and the measured rounds.

Run: python bench/scripts/distributed.py --model GROWN [--parallel tensor] [--head shard|replicate] [--compare-head]
     [--batch 1,8] [--depth 0,1,2,3] [--tokens 24] [--repeats 2] [--prompts 8] [--prompt-tokens 48] [--json out.json]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mtplx_ext import _blas, generate_greedy_batched
from mtplx_ext.benchmark import combined_runs, encode_prompts, engine_run, heldout_prompts, prompt_groups
from mtplx_ext.checkpoints import load, sharded
from mtplx_ext.shipped import BENCH_PROMPTS
from mtplx_ext.benchmark.provenance import provenance

COLLECTIVES = ("all_sum", "all_gather", "send", "recv_like", "recv")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _count_rounds(rt, prompts, depth: int) -> dict:
    """Collectives per cycle of an eager decode (the graph is built in Python every cycle)."""
    counts = {n: 0 for n in COLLECTIVES}
    orig = {n: getattr(mx.distributed, n) for n in COLLECTIVES}

    def counting(name):
        def f(*a, **k):
            counts[name] += 1
            return orig[name](*a, **k)
        return f

    for n in COLLECTIVES:
        setattr(mx.distributed, n, counting(n))
    try:
        r = generate_greedy_batched(rt, prompts, max_new_tokens=16, depth=max(depth, 1), use_mtp_draft=depth > 0,
                                    enforce_eager=True)
    finally:
        for n, f in orig.items():
            setattr(mx.distributed, n, f)
    total = sum(counts.values())
    per_stream = r.generated_tokens / len(prompts)
    return {"depth": depth, "batch": len(prompts), "collectives": counts, "cycles": r.cycles,
            "per_cycle": total / max(r.cycles, 1), "per_token": total / max(per_stream, 1)}


def _latency_ms(group, hidden: int) -> float:
    x = mx.ones((1, hidden))
    times = []
    for _ in range(200):
        t = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(args) -> dict:
    group = mx.distributed.init()
    # Ranks that share one machine's cores: a second GEMM thread per rank
    # would only oversubscribe them (each rank is one core's worth of work).
    split = args.gemm_split == "on" or (
        args.gemm_split == "auto" and 2 * group.size() <= (os.cpu_count() or 1))
    if not split:
        _blas.set_gemm_split_bytes(None)
        if group.size() <= (os.cpu_count() or 1) and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {group.rank()})  # one core per rank, as one rank per machine
    t = time.perf_counter()
    if group.size() > 1:
        rt = sharded.load(args.model, group=group, parallel=args.parallel, head=args.head)
    else:
        rt = load(args.model)
    load_s = time.perf_counter() - t
    other = None
    if args.compare_head and group.size() > 1:
        if args.parallel != "tensor":
            raise SystemExit("--compare-head needs tensor parallel: pipeline stages always replicate the head")
        other_mode = next(m for m in sharded.HEAD_MODES if m != sharded.resolve_head(args.parallel, args.head))
        other = (other_mode, sharded.load(args.model, group=group, parallel=args.parallel, head=other_mode))
    mem = {"after_load_mlx_peak_mb": mx.get_peak_memory() / 2**20, "after_load_rss_mb": _rss_mb(),
           "after_load_mlx_active_mb": mx.get_active_memory() / 2**20}
    if args.prompts > 0:
        prompts_all = heldout_prompts(rt.tokenizer, args.prompts, args.prompt_tokens, seed=args.seed)
    else:
        prompts_all = encode_prompts(rt.tokenizer, list(BENCH_PROMPTS))
    runs: dict[str, list[float]] = {}
    accept: dict[str, float] = {}
    cycle_s: dict[str, float] = {}
    for b in args.batch:
        # Every prompt decodes at every batch size (batch 1: each prompt alone, in turn), so batch 1 is
        # not one prompt's acceptance.
        groups = prompt_groups(prompts_all, b)
        prompts = groups[0]
        # (runtime, key suffix): the other head's runtime decodes MTP only (plain decoding never runs the head).
        configs = [(rt, "", args.depth)] + ([(other[1], f"-{other[0]}", [d for d in args.depth if d > 0])] if other else [])
        for model, _, depths in configs:  # warm-up: traces and compiles every shape
            for d in depths:
                generate_greedy_batched(model, prompts, max_new_tokens=8, depth=max(d, 1), use_mtp_draft=d > 0)
        for _ in range(args.repeats):
            for d, model, suffix in ((d, m, x) for d in args.depth for m, x, ds in configs if d in ds):
                r = combined_runs([engine_run(model, g, args.tokens, d > 0, depth=max(d, 1)) for g in groups])
                key = f"b{b}-d{d}{suffix}"
                print(f"[{group.size()} rank(s), rank {group.rank()}] {key}: {r.tokens_per_s:.2f} tokens/s",
                      file=sys.stderr, flush=True)
                runs.setdefault(key, []).append(r.tokens_per_s)
                accept[key] = r.accepted / max(1, r.stream_cycles) if d > 0 else 0.0
                cycle_s.setdefault(key, []).append(r.seconds / max(1, r.cycles))
    rounds = [_count_rounds(rt, [prompts_all[0]] * b, d) for b in args.batch for d in args.depth] if group.size() > 1 else []
    hidden = int(rt.config.get("hidden_size", 0))
    out = {
        "ranks": group.size(), "rank": group.rank(), "gemm_split": split, "parallel": args.parallel if group.size() > 1 else "none",
        "head": sharded.resolve_head(args.parallel, args.head) if group.size() > 1 else "none",
        "load_s": load_s, "tokens_per_s": {k: statistics.median(v) for k, v in runs.items()},
        "tokens_per_s_all": runs, "mean_accepted_length": accept,
        "cycle_ms": {k: statistics.median(v) * 1e3 for k, v in cycle_s.items()},
        "rounds": rounds, "collective_ms": _latency_ms(group, hidden) if group.size() > 1 else 0.0,
        "memory": {**mem, "end_mlx_peak_mb": mx.get_peak_memory() / 2**20, "end_rss_mb": _rss_mb(),
                   "end_mlx_active_mb": mx.get_active_memory() / 2**20},
    }
    return out


def _free_ports(n: int) -> list[int]:
    import socket  # noqa: PLC0415

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _launch(argv: list[str], ranks: int, tmp: Path, timeout: float) -> list[dict]:
    env = dict(os.environ)
    procs = []
    outs = [tmp / f"r{ranks}.{r}.json" for r in range(ranks)]
    if ranks > 1:
        hosts = tmp / f"hosts{ranks}.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(ranks)]))
        env["MLX_HOSTFILE"] = str(hosts)
    for r in range(ranks):
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--out", str(outs[r])],
                                      env={**env, "MLX_RANK": str(r)}))
    for p in procs:
        p.wait(timeout=timeout)
        if p.returncode != 0:
            raise SystemExit(f"a rank exited {p.returncode}")
    return [json.loads(o.read_text()) for o in outs]


def paper_model(single: dict, dist: dict, link_us: list[float], macs: list[int]) -> list[dict]:
    """Per-token time for M ranks: the one-process cycle split M ways plus rounds x link latency."""
    rows = []
    for r in dist["rounds"]:
        key = f"b{r['batch']}-d{r['depth']}"
        if key not in single["cycle_ms"]:
            continue
        compute_ms = single["cycle_ms"][key]
        tokens_per_cycle = r["per_token"] and r["per_cycle"] / r["per_token"]
        for lat in link_us:
            for m in macs:
                cyc = compute_ms / m + r["per_cycle"] * lat / 1e3
                rows.append({"key": key, "macs": m, "link_us": lat, "cycle_ms": cyc,
                             "tokens_per_s_per_stream": tokens_per_cycle / cyc * 1e3})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--parallel", choices=sharded.PARALLEL_MODES, default="tensor")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--head", choices=sharded.HEAD_MODES,
                    help="the MTP head on the ranks (default: shard in tensor parallel, replicate pipelined)")
    ap.add_argument("--compare-head", action="store_true",
                    help="also decode with the other head mode on the ranks, interleaved per repeat")
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--depth", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (0: the bench's own openings)")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gemm-split", choices=("auto", "on", "off"), default="auto",
                    help="the decode GEMM's second thread per rank (auto: on while ranks x 2 <= cores)")
    ap.add_argument("--link-us", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 50.0, 200.0])
    ap.add_argument("--json")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if "MLX_RANK" in os.environ:
        res = measure(args)
        Path(args.out).write_text(json.dumps(res))
        return 0
    argv = [a for a in sys.argv[1:]]
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        single = _launch(argv, 1, Path(tmp), 3600)[0]
        ranks = _launch(argv, args.ranks, Path(tmp), 3600)
    report = {"command": "python bench/scripts/distributed.py " + " ".join(argv), "loadavg_before": load,
              "loadavg_after": os.getloadavg(), "single": single, "ranks": ranks,
              "paper": paper_model(single, ranks[0], args.link_us, [2, 3, 4])}
    print(f"load average before {load[0]:.1f}, after {report['loadavg_after'][0]:.1f}")
    print(f"{'config':<10}" + "".join(f"{k:>11}" for k in single["tokens_per_s"]))
    print(f"{'1 process':<10}" + "".join(f"{v:>11.2f}" for v in single["tokens_per_s"].values()))
    tps = ranks[0]["tokens_per_s"]
    print(f"{f'{args.ranks} ranks':<10}" + "".join(f"{tps[k]:>11.2f}" for k in single["tokens_per_s"]))
    extra = [k for k in tps if k not in single["tokens_per_s"]]
    if extra:  # --compare-head: the other head mode, same run
        print(f"{args.ranks} ranks, other head: " + ", ".join(f"{k} {tps[k]:.2f}" for k in extra))
    print("mean accepted length (2 ranks):", {k: round(v, 2) for k, v in ranks[0]["mean_accepted_length"].items()})
    print("cycle ms 1 process:", {k: round(v, 1) for k, v in single["cycle_ms"].items()})
    print(f"cycle ms {args.ranks} ranks:", {k: round(v, 1) for k, v in ranks[0]["cycle_ms"].items()})
    for r in ranks[0]["rounds"]:
        print(f"rounds b{r['batch']} d{r['depth']}: {r['per_cycle']:.0f} per cycle, {r['per_token']:.1f} per token, {r['collectives']}")
    print(f"collective latency (all_sum [1, hidden]): {ranks[0]['collective_ms']:.3f} ms")
    for r in [single] + ranks:
        print(f"memory ranks={r['ranks']} rank {r['rank']}: {r['memory']}")
    if args.json:
        report["provenance"] = provenance([args.model])
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
