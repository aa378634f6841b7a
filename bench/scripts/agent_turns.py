"""An agent's turns on a hybrid model: time to first token with the block prefix cache and without, its bytes,
and the first turn after a restart over the cache's disk tier.

Each turn resends the whole conversation (system prompt, every earlier
message and reply) plus a new message of --message tokens, as agents do;
the engine decodes the reply greedily. Text is cut from held-out Python
stdlib files. Per conversation, side by side and turn by turn: an engine
without the cache, and one with it (RAM and a disk directory). After the
turns: the cache's RAM bytes against the KV of the last prompt alone (its
slots times the bytes a slot takes in every attention layer of trunk and
head), and a "restart": a new engine over the same directory (its RAM tier
empty) and a cold one each answer the conversation's next turn. Medians
over --repeats conversations, after one that warms everything up.

Run: PYTHONPATH=python python bench/scripts/agent_turns.py [--model DIR] [--turns 10] [--system 400]
     [--message 250] [--reply 32] [--repeats 2] [--json bench/results/agent_turns_hybrid.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mtplx_ext  # first: loads the fast BLAS before mlx.core
from mtplx_ext import benchmark
from mtplx_ext.batching import Engine
from mtplx_ext.batching.prefix_blocks import Node, State
from mtplx_ext.benchmark.provenance import provenance

HYBRID = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-next-mtp"


def turn(eng: Engine, prompt: list[int], reply: int) -> dict:
    """One request: its time to first token, prefilled tokens and reply."""
    before = eng.metrics()["prefill_tokens"]
    t0 = time.perf_counter()
    r = eng.submit(prompt, max_tokens=reply)
    eng.run_until_idle()
    assert r.error is None, r.error
    return {"prompt_tokens": len(prompt), "prefilled": eng.metrics()["prefill_tokens"] - before,
            "ttft_s": r.first_token_s - t0, "tokens": r.tokens}


def cache_bytes(eng: Engine, last_prompt: int) -> dict:
    """The cache's RAM bytes (KV blocks, recurrent states) and the KV of `last_prompt` slots alone."""
    items = list(eng.prefix.ram.items.values())
    node = next(n for n in items if isinstance(n, Node))
    kv = sum(n.nbytes for n in items if isinstance(n, Node))
    states = sum(s.nbytes for s in items if isinstance(s, State))
    alone = node.nbytes / node.slots * last_prompt
    return {"ram_bytes": eng.prefix.ram.bytes, "kv_bytes": kv, "state_bytes": states,
            "states": sum(isinstance(s, State) for s in items), "last_prompt_kv_bytes": int(alone),
            "ratio": eng.prefix.ram.bytes / alone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(HYBRID))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system", type=int, default=400, help="system prompt tokens")
    ap.add_argument("--message", type=int, default=250, help="tokens of each new message")
    ap.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    rt = mtplx_ext.load(a.model)
    disk = Path(tempfile.mkdtemp(prefix="agent-turns-"))
    opts = dict(max_batch=1, depth=a.depth, prefill_chunk=256)
    cold = Engine(rt, **opts)
    cached = Engine(rt, **opts, prefix_cache_bytes=1 << 30, prefix_cache_dir=disk)
    runs: dict[str, list[list[dict]]] = {"no cache": [], "prefix cache": []}
    sizes, restarts, same = [], [], True
    for rep in range(a.repeats + 1):  # the first conversation warms both up
        parts = benchmark.heldout_prompts(rt.tokenizer, a.turns + 2, max(a.system, a.message), seed=rep)
        system, messages = parts[0][: a.system], [p[: a.message] for p in parts[1:]]
        hist = {"no cache": list(system), "prefix cache": list(system)}
        conv: dict[str, list[dict]] = {k: [] for k in runs}
        for t in range(a.turns):
            for name, eng in (("no cache", cold), ("prefix cache", cached)):
                prompt = hist[name] + messages[t]
                conv[name].append(turn(eng, prompt, a.reply))
                hist[name] = prompt + conv[name][-1]["tokens"]
        same &= all(x["tokens"] == y["tokens"] for x, y in zip(conv["no cache"], conv["prefix cache"]))
        size = cache_bytes(cached, conv["prefix cache"][-1]["prompt_tokens"])
        # The restart: the conversation's next turn on a new engine over the disk, and on a cold one.
        cached.prefix.flush()
        nxt = hist["prefix cache"] + messages[a.turns]
        fresh = Engine(rt, **opts, prefix_cache_bytes=1 << 30, prefix_cache_dir=disk)
        warm, coldr = turn(fresh, nxt, a.reply), turn(Engine(rt, **opts), nxt, a.reply)
        same &= warm["tokens"] == coldr["tokens"]
        m = fresh.metrics()
        restart = {"prompt_tokens": len(nxt), "ttft_disk_s": warm["ttft_s"], "ttft_cold_s": coldr["ttft_s"],
                   "prefilled": warm["prefilled"], "disk_hits": m["prefix_disk_hits"],
                   "disk_bytes": m["prefix_bytes_disk"]}
        fresh.prefix.close()
        # Each conversation starts from an empty RAM tier (the disk keeps the earlier ones).
        cached.prefix.reset()
        if rep:
            for k in runs:
                runs[k].append(conv[k])
            sizes.append(size)
            restarts.append(restart)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"{a.turns} turns, system {a.system} + {a.message} tokens per message, {a.reply}-token replies, depth "
          f"{a.depth}; medians of {a.repeats} conversations; same replies with and without the cache: {same}")
    print("| turn | prompt tokens | prefilled (no cache) | prefilled (cache) | TTFT no cache ms | TTFT cache ms | x |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for t in range(a.turns):
        m_ = {n: {k: med([c[t][k] for c in runs[n]]) for k in ("prompt_tokens", "prefilled", "ttft_s")} for n in runs}
        x, y = m_["no cache"], m_["prefix cache"]
        rows.append({"turn": t + 1, **{f"{n}_{k}": v for n in m_ for k, v in m_[n].items()},
                     "speedup": x["ttft_s"] / y["ttft_s"]})
        print(f"| {t + 1} | {x['prompt_tokens']:.0f} | {x['prefilled']:.0f} | {y['prefilled']:.0f} | "
              f"{x['ttft_s'] * 1e3:.1f} | {y['ttft_s'] * 1e3:.1f} | {x['ttft_s'] / y['ttft_s']:.2f} |")
    size = {k: med([s[k] for s in sizes]) for k in sizes[0]}
    print(f"cache after {a.turns} turns: {size['ram_bytes'] / 2**20:.2f} MiB in RAM ({size['kv_bytes'] / 2**20:.2f} KV, "
          f"{size['states']:.0f} states {size['state_bytes'] / 2**20:.2f}); the last prompt's KV alone "
          f"{size['last_prompt_kv_bytes'] / 2**20:.2f} MiB: {size['ratio']:.2f}x")
    rs = {k: med([r[k] for r in restarts]) for k in restarts[0]}
    print(f"after a restart, next turn ({rs['prompt_tokens']:.0f} tokens): TTFT {rs['ttft_disk_s'] * 1e3:.1f} ms over "
          f"the disk tier ({rs['prefilled']:.0f} prefilled, {rs['disk_hits']:.0f} files read) vs "
          f"{rs['ttft_cold_s'] * 1e3:.1f} ms cold: {rs['ttft_cold_s'] / rs['ttft_disk_s']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "same_replies": same, "cache_bytes": size, "restart": rs,
                       "turn_last_speedup": rows[-1]["speedup"], "restart_speedup": rs["ttft_cold_s"] / rs["ttft_disk_s"],
                       "versions": benchmark.versions(), "provenance": provenance([a.model])}, f, indent=2)


if __name__ == "__main__":
    main()
