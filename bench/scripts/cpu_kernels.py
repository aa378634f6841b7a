"""What the CPU kernels buy: one trunk forward of the shipped model, side by side.

Compiled [B, T] forwards over fixed-capacity ragged caches after a 64-token
prefill (T = 1 is a plain decode step, T = K + 1 a depth-K verification),
under three settings interleaved in every round:

* base: fused RMSNorm / RoPE / attention, mlx-lm's own swiglu, every GEMM
  through OpenBLAS;
* +swiglu: mlx-lm's swiglu routed to the fused `swiglu` (`patch_mlx_lm_swiglu`);
* +small gemm: also the BLAS shim's kernel for products with at most 8 rows
  (`_blas.set_small_gemm_rows`), which skips OpenBLAS's packing.

The settings alternate step by step; medians of the per-step times; the
ratio columns are base / setting.

With --decode: whole greedy decodes instead (8 held-out prompts, 128 new
tokens, compiled steps, everything fused), plain and MTP at --depth, with
the small GEMM off and on, interleaved per repeat: what the kernel changes
for each end to end, and for the MTP / plain ratio.

Run: python bench/scripts/cpu_kernels.py [--batch 1,8] [--tokens 1,2,3,4,5,6] [--rounds 7] [--steps 20]
     python bench/scripts/cpu_kernels.py --decode [--batch 1,8] [--depth 1,2,3] [--repeats 5]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import contextlib
import statistics
import time

import mlx.core as mx

from mtplx_ext import _blas
from mtplx_ext.cache import rollback as cache_state
from mtplx_ext.cache.compiled_step import CompiledStep
from mtplx_ext.models.mlx_lm_patches import patch_mlx_lm_attention, patch_mlx_lm_swiglu
from mtplx_ext.shipped import SHIPPED_MODEL
from mtplx_ext import benchmark

PREFILL = 64
SETTINGS = ("base", "+swiglu", "+small gemm")


def forwards(rt, batch: int, ts: list[int]) -> dict[int, CompiledStep]:
    cache = rt.make_cache([0] * batch, ragged=True, capacity=PREFILL + max(ts) + 8)
    prompt = mx.random.randint(0, rt.vocab_size, (batch, PREFILL)).astype(mx.int32)
    rt.forward(prompt, cache)
    mx.eval([c.state for c in cache])

    def make(T: int) -> CompiledStep:
        def step(tokens: mx.array) -> mx.array:
            logits, _ = rt.forward(tokens, cache)
            cache_state.rollback_streams(cache, mx.full((batch,), T, mx.int32))  # stay at the prefill
            return mx.argmax(logits, axis=-1)

        return CompiledStep(step, [cache])

    return {T: make(T) for T in ts}


def decode(rt, batches: list[int], depths: list[int], repeats: int, small: int) -> None:
    prompts = benchmark.heldout_prompts(rt.tokenizer, 8, 48, seed=0)
    methods = [("plain", 1)] + [(f"MTP depth {d}", d) for d in depths]
    print(f"BLAS: {_blas.describe()}; 8 held-out prompts, 128 new tokens, medians of {repeats} interleaved repeats")
    print("| batch | decoding | tokens/s, OpenBLAS only | tokens/s, + small gemm | small gemm speedup | "
          "x plain, OpenBLAS only | x plain, + small gemm |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for batch in batches:
        groups = benchmark.prompt_groups(prompts, batch)
        tps: dict[tuple[str, int], list[float]] = {}
        for rep in range(repeats + 1):  # the first repeat traces and warms up
            for name, d in methods:
                for rows in (0, small):
                    _blas.set_small_gemm_rows(rows)
                    r = benchmark.combined_runs([benchmark.engine_run(rt, g, 128, name != "plain", depth=d) for g in groups])
                    if rep:
                        tps.setdefault((name, rows), []).append(r.tokens_per_s)
        med = {k: statistics.median(v) for k, v in tps.items()}
        ratio = {k: statistics.median(a / p for a, p in zip(v, tps["plain", k[1]])) for k, v in tps.items()}
        for name, _ in methods:
            a, b = med[name, 0], med[name, small]
            print(f"| {batch} | {name} | {a:.1f} | {b:.1f} | {statistics.median(y / x for x, y in zip(tps[name, 0], tps[name, small])):.2f} | "
                  f"{ratio[name, 0]:.2f} | {ratio[name, small]:.2f} |", flush=True)
    _blas.set_small_gemm_rows(small)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", default="1,2,3,4,5,6")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--decode", action="store_true", help="whole decodes instead of single forwards")
    ap.add_argument("--depth", default="1,2,3")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rt = mtplx_ext.load(args.model)
    if args.decode:
        small = _blas.set_small_gemm_rows(8)
        _blas.set_small_gemm_rows(small)
        decode(rt, [int(b) for b in args.batch.split(",")], [int(d) for d in args.depth.split(",")], args.repeats, small)
        return
    ts = [int(t) for t in args.tokens.split(",")]
    print(f"BLAS: {_blas.describe()}; medians of {args.rounds} interleaved rounds of {args.steps} steps")
    print("| batch | T | base ms | +swiglu ms | +small gemm ms | base / +swiglu | base / +small gemm | "
          "T / T=1 (base) | T / T=1 (+small gemm) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    small = _blas.set_small_gemm_rows(0)
    try:
        with patch_mlx_lm_attention():
            for batch in (int(b) for b in args.batch.split(",")):
                times = {(s, T): [] for s in SETTINGS for T in ts}
                # One set of traced steps per setting: the routing is baked into the trace.
                steps = {}
                for s in SETTINGS:
                    with patch_mlx_lm_swiglu() if s != "base" else contextlib.nullcontext():
                        steps[s] = forwards(rt, batch, ts)
                tok = {T: mx.random.randint(0, rt.vocab_size, (batch, T)).astype(mx.int32) for T in ts}
                # Round 0 traces each step under its setting's routing (baked into the
                # trace); then the settings alternate step by step, so a noisy
                # neighbour hits all of them alike.
                for rnd in range(args.rounds + 1):
                    for T in ts:
                        for _ in range(args.steps if rnd else 2):
                            for s in SETTINGS:
                                _blas.set_small_gemm_rows(small if s == "+small gemm" else 0)
                                with patch_mlx_lm_swiglu() if s != "base" and not rnd else contextlib.nullcontext():
                                    t0 = time.perf_counter()
                                    mx.eval(steps[s][T](tok[T]))
                                    if rnd:
                                        times[s, T].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                for T in ts:
                    b, w, g = (med[s, T] for s in SETTINGS)
                    print(f"| {batch} | {T} | {b:.2f} | {w:.2f} | {g:.2f} | {b / w:.2f} | {b / g:.2f} | "
                          f"{b / med['base', 1]:.2f} | {g / med['+small gemm', 1]:.2f} |", flush=True)
    finally:
        _blas.set_small_gemm_rows(small)


if __name__ == "__main__":
    main()
