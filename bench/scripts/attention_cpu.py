"""The fused CPU attention over a fixed-capacity ragged KV cache, side by side with MLX's own.

Decode-time shapes of a GQA model (default: the grown model's 24 query and
8 kv heads of 64): B streams, T query tokens each (T = 1 a plain step,
T = K + 1 a verification), keys in a cache of `capacity` slots of which
each stream sees its first `visible` (+ its T new ones); the rest lie past
the streams' ends, as in the engine's compiled steps. Per shape, interleaved
per round, medians of the rounds (microseconds per call):

* fused 1t: `mtplx_ext.scaled_dot_product_attention` on one thread;
* fused: the same, its (batch, kv head) jobs on the CPU pool;
* mx.fast: `mx.fast.scaled_dot_product_attention` with the same bool mask.

Run: python bench/scripts/attention_cpu.py [--batch 1,8] [--tokens 1,3,6] [--capacity 128,1024]
     [--visible 100,900] [--rounds 15]
"""

from __future__ import annotations

import mtplx_ext

import argparse
import statistics
import time

import mlx.core as mx

from mtplx_ext.ops.threads import cpu_threads, set_cpu_threads


def setting_time(name: str, q, k, v, mask, calls: int) -> float:
    set_cpu_threads(1 if name == "fused 1t" else 0)
    attend = mx.fast.scaled_dot_product_attention if name == "mx.fast" else mtplx_ext.scaled_dot_product_attention
    t0 = time.perf_counter()
    mx.eval([attend(q, k, v, scale=0.125, mask=mask) for _ in range(calls)])
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", default="1,3,6")
    ap.add_argument("--capacity", default="128,1024")
    ap.add_argument("--visible", default="100,900", help="slots each stream sees, one per capacity")
    ap.add_argument("--heads", default="24,8,64", help="query heads, kv heads, head dim")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=16)
    args = ap.parse_args()
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    caps = [int(c) for c in args.capacity.split(",")]
    vis = [int(c) for c in args.visible.split(",")]
    if len(vis) != len(caps) or any(s > c for s, c in zip(vis, caps)):
        raise SystemExit("--visible needs one count per --capacity, each at most its capacity")
    settings = ("fused 1t", "fused", "mx.fast")
    print(f"{hq} query heads, {hkv} kv heads of {d}, float32; {cpu_threads()} CPU threads; medians of {args.rounds} "
          f"rounds of {args.calls} calls")
    print("| B | T | capacity | visible | fused 1t us | fused us | mx.fast us | 1t / fused | mx.fast / fused |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cap, seen in zip(caps, vis):
        for b in (int(x) for x in args.batch.split(",")):
            for t in (int(x) for x in args.tokens.split(",")):
                q = mx.random.normal((b, hq, t, d))
                k = mx.random.normal((b, hkv, cap, d))
                v = mx.random.normal((b, hkv, cap, d))
                slots = mx.arange(cap)
                mask = (slots[None, None, None, :] < seen + mx.arange(1, t + 1)[None, None, :, None])
                mask = mx.broadcast_to(mask, (b, 1, t, cap))
                mx.eval(q, k, v, mask)
                times: dict[str, list[float]] = {s: [] for s in settings}
                for rnd in range(args.rounds + 1):  # round 0 warms up
                    for s in settings:
                        dt = setting_time(s, q, k, v, mask, args.calls)
                        if rnd:
                            times[s].append(dt)
                med = {s: statistics.median(x) * 1e6 for s, x in times.items()}
                print(f"| {b} | {t} | {cap} | {seen} | {med['fused 1t']:.0f} | {med['fused']:.0f} | "
                      f"{med['mx.fast']:.0f} | {med['fused 1t'] / med['fused']:.2f} | "
                      f"{med['mx.fast'] / med['fused']:.2f} |", flush=True)
    set_cpu_threads(0)


if __name__ == "__main__":
    main()
