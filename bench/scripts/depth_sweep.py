"""Depth sweep on held-out text: tokens/s, per-depth acceptance, and the bound the forwards allow.

For each batch size, in one run and interleaved per repeat: plain decoding
and MTP decoding at depths 1..K of the same prompts (cut at random from
Python stdlib files the shipped model was not trained on), greedy, compiled
steps. After every repeat, `--rounds` rounds of the cycle's parts (so that
the parts and the decodes see the same phases of a machine whose speed
drifts), timed as the engine runs them (compiled, launched back to back,
fixed-capacity ragged caches after a 64-token prefill), in units of one plain
step: a [B, K + 1] verification forward with `verify_greedy_chain`, and one
chained head step. With L the mean accepted length measured end to end, a
cycle commits 1 + L tokens for the price of verify(K + 1) + K head steps, so
MTP can beat plain decoding by at most

    bound(K) = (1 + L) / (verify(K + 1) + K * head)      (plain step = 1);

"x bound" says how much of that the engine keeps (the rest: the first
head call's extra positions, rollbacks, the host's bookkeeping, and in a
batch the tail: a fixed batch runs until its slowest stream is done, so
some rows of its last cycles belong to streams that already finished;
"live rows" is the share of rows that did not, relative to plain
decoding's, and "x (bound x live)" the engine's share of the bound with
that tail priced in).

--full-rows also runs every depth with `compact_rows=False` (the batch
keeps its finished streams' rows to the end), interleaved with the rest:
what dropping them buys.

--gemm routes the decode-sized products: the decode GEMM (default), the
older small-row kernel (at most 8 rows, OpenBLAS above) or OpenBLAS alone,
for side-by-side runs of the same model.

Run: python bench/scripts/depth_sweep.py [--model DIR] [--batch 1,8] [--depth 1,2,3,4,5] [--tokens 128]
     [--prompts 8] [--repeats 3] [--gemm decode|small|openblas] [--json out.json]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import json
import statistics
import time

import mlx.core as mx

from mtplx_ext import _blas
from mtplx_ext.cache import rollback as cache_state
from mtplx_ext.cache.compiled_step import CompiledStep
from mtplx_ext.models.mlx_lm_patches import patch_mlx_lm_ops
from mtplx_ext.ops.greedy_verify import verify_greedy_chain
from mtplx_ext.shipped import SHIPPED_MODEL
from mtplx_ext import benchmark
from mtplx_ext.benchmark.provenance import provenance

PREFILL = 64


def end_to_end(rt, prompts, batch: int, depths: list[int], n: int, repeats: int, full_rows: bool = False,
               between=None) -> dict:
    """Medians over repeats (methods interleaved per repeat) of whole decodes of all prompts.

    With `full_rows` every MTP depth also runs with `compact_rows=False`
    ("k{d} full": the batch keeps its finished rows to the end). `between()`
    runs after every timed repeat (one round of the parts' timings: the bound
    is then measured in the same phases of the machine as the decodes).
    """
    groups = benchmark.prompt_groups(prompts, batch)
    methods = ["plain"] + [f"k{d}" for d in depths] + ([f"k{d} full" for d in depths] if full_rows else [])
    runs: dict[str, list[benchmark.Run]] = {m: [] for m in methods}
    for rep in range(repeats + 1):  # the first round warms up (traces, kernels)
        for m in methods:
            mtp, d = m != "plain", int(m[1:].split()[0]) if m != "plain" else 1
            r = benchmark.combined_runs([benchmark.engine_run(rt, g, n, mtp, depth=d, compact_rows=not m.endswith("full"))
                                         for g in groups])
            if rep:
                runs[m].append(r)
        if rep and between is not None:
            between()
    out = {}
    for m in methods:
        rs = runs[m]
        out[m] = {
            "tokens_per_s": statistics.median(r.tokens_per_s for r in rs),
            "x_plain": statistics.median(r.tokens_per_s / q.tokens_per_s for r, q in zip(rs, runs["plain"])),
            "mean_accepted_length": sum(r.accepted for r in rs) / max(1, sum(r.stream_cycles for r in rs)),
            "acceptance_per_depth": [
                sum(r.accepted_at[i] for r in rs) / max(1, sum(r.reached[i] for r in rs))
                for i in range(len(rs[0].reached))
            ],
            # Rows of the batch's forwards that belonged to a stream still decoding: a fixed batch runs
            # until its slowest stream is done, and MTP's streams finish at different cycles (a plain
            # cycle gives each live stream one token); a batch that drops its finished rows forwards
            # fewer rows (row_cycles).
            "live_rows": sum(r.tokens if m == "plain" else r.stream_cycles for r in rs)
            / max(1, sum(r.row_cycles for r in rs)),
            "row_cycles": sum(r.row_cycles for r in rs),
            "same_tokens_as_plain": sum(a == b for a, b in zip(rs[0].outputs, runs["plain"][0].outputs)),
            "streams": len(rs[0].outputs),
        }
    return out


class Parts:
    """Compiled cycle parts for one batch size, on freshly prefilled caches."""

    def __init__(self, rt, batch: int, max_depth: int, steps: int):
        self.rt, self.B = rt, batch
        cap = PREFILL + max_depth + 8
        self.cache = rt.make_cache([0] * batch, ragged=True, capacity=cap)
        self.head_cache = rt.make_head_cache([0] * batch, ragged=True, capacity=cap)
        prompt = mx.random.randint(0, rt.vocab_size, (batch, PREFILL + 1)).astype(mx.int32)
        _, hidden = rt.forward(prompt[:, :-1], self.cache)
        rt.head_states(hidden, prompt[:, 1:], self.head_cache)
        mx.eval([c.state for c in self.cache + self.head_cache])
        self.hidden = mx.random.normal((batch, 1, hidden.shape[-1]))
        self.steps = steps

    def forward(self, T: int):
        def step(tokens: mx.array) -> mx.array:
            logits, _ = self.rt.forward(tokens[:, :T], self.cache)
            cache_state.rollback_streams(self.cache, mx.full((self.B,), T, mx.int32))  # stay at the prefill
            return mx.argmax(logits[:, -1], axis=-1) if T == 1 else verify_greedy_chain(logits, tokens[:, :T])

        return CompiledStep(step, [self.cache])

    def head(self) -> CompiledStep:
        def step(tokens: mx.array) -> mx.array:
            _, normed = self.rt.head_states(self.hidden, tokens[:, :1], self.head_cache)
            cache_state.rollback_streams(self.head_cache, mx.ones((self.B,), mx.int32))
            return mx.argmax(self.rt.head_logits(normed)[:, -1], axis=-1)

        return CompiledStep(step, [self.head_cache])

    def time(self, step: CompiledStep, T: int) -> float:
        """Seconds per step of `steps` steps run back to back, each launched before the last is done.

        As the engine's loop runs them: the host builds the next step while
        the CPU stream computes this one, so the time is the step's own, not
        plus the host's work (timing one synchronous call at a time adds that
        work to every part alike and so squeezes their ratios towards 1).
        """
        tokens = mx.random.randint(0, self.rt.vocab_size, (self.B, T)).astype(mx.int32)
        for _ in range(3):  # the first calls trace and warm up
            mx.eval(step(tokens))
        t = time.perf_counter()
        out = None
        for _ in range(self.steps):
            out = step(tokens)
            mx.async_eval(out)
        mx.eval(out)
        return (time.perf_counter() - t) / self.steps


class PartRounds:
    """Rounds of the parts' timings for one batch size: `round()` times each part once more."""

    def __init__(self, rt, batch: int, depths: list[int], steps: int):
        p = Parts(rt, batch, max(depths) + 1, steps)
        self.p = p
        self.named = {"plain": (p.forward(1), 1), "head": (p.head(), 1)}
        self.named.update({f"verify{d + 1}": (p.forward(d + 1), d + 1) for d in depths})
        self.rounds: list[dict] = []

    def round(self) -> None:
        self.rounds.append({k: self.p.time(s, T) for k, (s, T) in self.named.items()})

    def costs(self) -> dict:
        """Medians over the rounds, in plain steps of the same round, and the plain step in ms."""
        rs = self.rounds
        return {k: statistics.median(r[k] / r["plain"] for r in rs) for k in self.named} | {
            "plain_ms": statistics.median(r["plain"] for r in rs) * 1e3
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--depth", default="1,2,3,4,5")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the parts' timings after each repeat")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--plot", help="PNG: tokens/s and acceptance per depth (needs matplotlib)")
    ap.add_argument("--gemm", choices=("decode", "small", "openblas"), default="decode",
                    help="kernel for decode-sized products (default: the decode GEMM)")
    ap.add_argument("--full-rows", action="store_true",
                    help="also every depth with compact_rows=False (interleaved): batches keep finished rows")
    args = ap.parse_args()
    if args.gemm == "openblas":
        _blas.set_small_gemm_rows(0)
    else:
        _blas.set_gemm_kernel(args.gemm)
    depths = sorted({int(d) for d in args.depth.split(",")})
    rt = mtplx_ext.load(args.model)
    prompts = benchmark.heldout_prompts(rt.tokenizer, args.prompts, args.prompt_tokens, seed=args.seed)
    report = {"command": "python bench/scripts/depth_sweep.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items() if v is not None and v is not False and k != "model"
    ), "versions": benchmark.versions(), "batches": {}}
    floor = benchmark.streaming_floor(rt)
    report["floor"] = floor
    print(f"BLAS: {_blas.describe()}, decode-sized products: {args.gemm}; {args.prompts} held-out prompts of {args.prompt_tokens} tokens, "
          f"{args.tokens} new tokens, medians of {args.repeats} interleaved repeats")
    print(f"weight-streaming floor: {floor['weight_bytes'] / 1e9:.3f} GB / {floor['read_bandwidth'] / 1e9:.1f} GB/s "
          f"= {floor['floor_s'] * 1e3:.2f} ms per step")
    print("| batch | depth | tokens/s | x plain | acceptance per depth | mean accepted length | "
          "verify(K+1) / plain | head / plain | bound | x bound | live rows | x (bound x live) | same tokens as plain |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batch.split(",")):
        with patch_mlx_lm_ops():
            pr = PartRounds(rt, batch, depths, args.steps)
            e2e = end_to_end(rt, prompts, batch, depths, args.tokens, args.repeats, args.full_rows,
                             between=lambda: [pr.round() for _ in range(args.rounds)])
            cost = pr.costs()
        rows = []
        for d, name in [(d, f"k{d}") for d in depths] + [(d, f"k{d} full") for d in depths if f"k{d} full" in e2e]:
            m = e2e[name]
            bound = (1 + m["mean_accepted_length"]) / (cost[f"verify{d + 1}"] + d * cost["head"])
            # MTP's tokens per cycle count only live rows; so do plain decoding's.
            live = m["live_rows"] / e2e["plain"]["live_rows"]
            rows.append({"depth": d, "full_rows": name.endswith("full"), **m, "verify": cost[f"verify{d + 1}"],
                         "head": cost["head"], "bound": bound, "live_vs_plain": live})
            label = f"{d} (full rows)" if name.endswith("full") else str(d)
            print(f"| {batch} | {label} | {m['tokens_per_s']:.1f} | {m['x_plain']:.2f} | "
                  f"{'/'.join(f'{a:.2f}' for a in m['acceptance_per_depth'])} | {m['mean_accepted_length']:.2f} | "
                  f"{cost[f'verify{d + 1}']:.2f} | {cost['head']:.2f} | {bound:.2f} | {m['x_plain'] / bound:.2f} | "
                  f"{live:.2f} | {m['x_plain'] / (bound * live):.2f} | "
                  f"{m['same_tokens_as_plain']}/{m['streams']} |", flush=True)
        print(f"batch {batch}: plain step {cost['plain_ms']:.2f} ms = {cost['plain_ms'] / 1e3 / floor['floor_s']:.2f}x "
              "the weight-streaming floor", flush=True)
        report["batches"][batch] = {"plain": e2e["plain"], "plain_step_ms": cost["plain_ms"], "depths": rows}
    if args.json:
        report["provenance"] = provenance([args.model])
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)


def plot(report: dict, path: str) -> None:
    """Tokens/s x plain (with the bound) and per-depth acceptance, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for batch, b in report["batches"].items():
        ds = [r["depth"] for r in b["depths"]]
        line = ax.plot(ds, [r["x_plain"] for r in b["depths"]], "o-", label=f"batch {batch}: measured")[0]
        ax.plot(ds, [r["bound"] for r in b["depths"]], "--", color=line.get_color(), label=f"batch {batch}: bound")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("depth K (drafts per cycle)")
    ax.set_ylabel("MTP tokens/s / plain tokens/s")
    ax.legend(fontsize=8)
    deepest = max(report["batches"].values(), key=lambda b: len(b["depths"]))["depths"]
    for r in deepest:
        bx.plot(range(1, r["depth"] + 1), r["acceptance_per_depth"], "o-", label=f"K = {r['depth']}")
    bx.set_xlabel("draft position i")
    bx.set_ylabel("accepted / reached at position i")
    bx.set_ylim(0, 1)
    bx.legend(fontsize=8)
    fig.suptitle("shipped model, held-out prompts, greedy, MLX CPU backend")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
