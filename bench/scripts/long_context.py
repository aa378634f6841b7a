"""Long contexts: decode speed of plain and MTP decoding against context length, float and quantized KV.

For each context length (held-out prompts of that many tokens), batch size
and KV setting (float, `--kv-bits` 8 / 4), the same prompts are decoded
plainly and at each MTP depth, interleaved per round; medians of the rounds
of decode-only tokens/s (prefill excluded: `r.decode_s`), MTP / plain, the
KV bytes per stream and the memory floor of a plain step (weights plus
every stream's KV, at the measured read bandwidth: `plain/floor`). Prefill
tokens/s of each prompt length is reported too.

Run: python bench/scripts/long_context.py [--model DIR] [--contexts 64,1000,3000] [--batch 1,4]
     [--kv float,8,4] [--depths 1,3] [--new 32] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import mtplx_ext

import argparse
import json
import statistics
import time

import mlx.core as mx

from mtplx_ext import benchmark, generate_greedy_batched
from mtplx_ext.shipped import SHIPPED_MODEL
from mtplx_ext.benchmark.provenance import provenance


def kv_bytes_per_token(rt, kv_bits: int | None) -> float:
    """Bytes one token's keys and values take over the trunk's attention layers (a 256-token prefill)."""
    cache = rt.make_cache([0], ragged=True, kv_bits=kv_bits)
    rt.trunk(mx.array([[1] * 256]), cache=cache)
    mx.eval([c.state for c in cache])
    return sum(c.nbytes for c in cache if hasattr(c, "buffers")) / 256


def decode(rt, prompts, new: int, depth: int, kv_bits) -> tuple[float, float, float]:
    r = generate_greedy_batched(rt, prompts, max_new_tokens=new, use_mtp_draft=depth > 0, depth=max(depth, 1),
                                kv_bits=kv_bits)
    return r.generated_tokens / r.decode_s, r.prefill_s, r.acceptance_rate if depth else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--contexts", default="64,1000,3000")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--kv", default="float,8,4")
    ap.add_argument("--depths", default="1,3")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    rt = mtplx_ext.load(args.model)
    kvs = [None if k == "float" else int(k) for k in args.kv.split(",")]
    depths = [0] + [int(d) for d in args.depths.split(",")]
    per_token = {kv: kv_bytes_per_token(rt, kv) for kv in kvs}
    floor = benchmark.streaming_floor(rt)
    bw = floor["read_bandwidth"]
    print(f"weights {floor['weight_bytes'] / 1e9:.2f} GB, read bandwidth {bw / 1e9:.1f} GB/s")
    print("KV bytes per token: " + ", ".join(f"{kv or 'float'}: {b:.0f} ({b / per_token[kvs[0]]:.3f}x)" for kv, b in per_token.items()))
    rows = []
    print(f"model {args.model}; {args.new} new tokens; medians of {args.rounds} rounds; decode tokens/s")
    for ctx in (int(c) for c in args.contexts.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            prompts = benchmark.heldout_prompts(rt.tokenizer, B, ctx, seed=args.seed + ctx)
            for kv in kvs:
                decode(rt, prompts, 4, 0, kv)  # warm: compile this shape's steps
                res = {d: [] for d in depths}
                prefill = []
                for _ in range(args.rounds):
                    for d in depths:
                        tps, pre, acc = decode(rt, prompts, args.new, d, kv)
                        res[d].append((tps, acc))
                        if d == 0:
                            prefill.append(B * ctx / pre)
                med = {d: statistics.median(t for t, _ in res[d]) for d in depths}
                acc = {d: statistics.median(a for _, a in res[d]) for d in depths}
                # A plain step streams the weights and every stream's KV once.
                floor_s = (floor["weight_bytes"] + B * ctx * per_token[kv]) / bw
                row = {"context": ctx, "batch": B, "kv_bits": kv, "kv_bytes_per_token": per_token[kv],
                       "plain_floor_tok_s": B / floor_s, "plain": med[0],
                       **{f"depth{d}": med[d] for d in depths if d}, **{f"acc{d}": acc[d] for d in depths if d},
                       "prefill_tok_s": statistics.median(prefill)}
                rows.append(row)
                best = max((med[d], d) for d in depths if d)
                print(f"ctx {ctx:5d} B {B} kv {str(kv or 'f32'):>3}: plain {med[0]:7.1f}  "
                      + "  ".join(f"d{d} {med[d]:7.1f} ({med[d] / med[0]:.2f}x, acc {acc[d]:.2f})" for d in depths if d)
                      + f"  best {best[0] / med[0]:.2f}x  plain/floor {med[0] * floor_s / B:.2f}"
                      + f"  prefill {row['prefill_tok_s']:.0f} tok/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python bench/scripts/long_context.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "json"),
                "versions": benchmark.versions(), "rows": rows, "provenance": provenance([args.model])}, f, indent=1)


if __name__ == "__main__":
    main()
