"""Time to first token of an agent-style conversation's turns, with the prefix cache and without.

Each turn resends the whole conversation (system prompt, every earlier
message and reply) plus a new message, as agents do; the engine decodes the
reply greedily. The conversation is cut from held-out Python stdlib files
(text the shipped model never saw). With and without the cache run side by
side, turn by turn, over --repeats conversations; medians.

Run: python bench/scripts/prefix_cache.py [--model DIR] [--turns 10] [--system 400] [--message 60] [--reply 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mtplx_ext  # first: loads the fast BLAS before mlx.core
from mtplx_ext import benchmark
from mtplx_ext.batching import Engine
from mtplx_ext.shipped import SHIPPED_MODEL
from mtplx_ext.benchmark.provenance import provenance


def conversation(eng: Engine, system: list[int], messages: list[list[int]], reply: int) -> list[dict]:
    """Runs the turns; per turn: prompt tokens, prefilled tokens, time to first token."""
    history = list(system)
    out = []
    for msg in messages:
        prompt = history + msg
        before = eng.metrics()["prefill_tokens"]
        t0 = time.perf_counter()
        r = eng.submit(prompt, max_tokens=reply)
        eng.run_until_idle()
        out.append({"prompt_tokens": len(prompt), "prefilled": eng.metrics()["prefill_tokens"] - before,
                    "ttft_s": r.first_token_s - t0, "tokens": r.tokens})
        history = prompt + r.tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system", type=int, default=400, help="system prompt tokens")
    ap.add_argument("--message", type=int, default=60, help="tokens of each new message")
    ap.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    rt = mtplx_ext.load(a.model)
    engines = {"no cache": Engine(rt, max_batch=1, depth="auto"),
               "prefix cache": Engine(rt, max_batch=1, depth="auto", prefix_cache_bytes=512 << 20)}
    runs: dict[str, list[list[dict]]] = {k: [] for k in engines}
    for rep in range(a.repeats + 1):  # the first conversation warms both up
        parts = benchmark.heldout_prompts(rt.tokenizer, a.turns + 1, max(a.system, a.message), seed=rep)
        system, messages = parts[0][: a.system], [p[: a.message] for p in parts[1:]]
        for name, eng in engines.items():
            turns = conversation(eng, system, messages, a.reply)
            if rep:
                runs[name].append(turns)
    same = all(x["tokens"] == y["tokens"] for c, d in zip(runs["no cache"], runs["prefix cache"]) for x, y in zip(c, d))
    print(f"{a.turns} turns, system {a.system} + {a.message} tokens per message, {a.reply}-token replies; "
          f"medians of {a.repeats} conversations; same replies with and without the cache: {same}")
    print("| turn | prompt tokens | prefilled (no cache) | prefilled (cache) | TTFT no cache ms | TTFT cache ms | x |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for t in range(a.turns):
        med = {n: {k: statistics.median(c[t][k] for c in runs[n]) for k in ("prompt_tokens", "prefilled", "ttft_s")}
               for n in runs}
        a_, b_ = med["no cache"], med["prefix cache"]
        rows.append({"turn": t + 1, **{f"{n}_{k}": v for n in med for k, v in med[n].items()}})
        print(f"| {t + 1} | {a_['prompt_tokens']:.0f} | {a_['prefilled']:.0f} | {b_['prefilled']:.0f} | "
              f"{a_['ttft_s'] * 1e3:.1f} | {b_['ttft_s'] * 1e3:.1f} | {a_['ttft_s'] / b_['ttft_s']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "same_replies": same, "versions": benchmark.versions(),
                       "provenance": provenance([a.model])}, f, indent=2)


if __name__ == "__main__":
    main()
