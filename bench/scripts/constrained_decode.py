"""Constrained decoding with and without MTP: a JSON schema, batch 1, greedy, side by side.

In one run, interleaved per repeat (the first round warms up): plain
constrained decoding, constrained MTP at each depth, and the unconstrained
plain and MTP decodes of the same prompts for reference. Each decode is one
prompt (batch 1) under a fresh matcher of the same JSON schema, until the
schema's JSON is complete (end-of-text) or `--tokens`. Greedy constrained
MTP commits exactly the tokens plain constrained decoding commits (tested),
so tokens/s compare the same work. Reported: median decode tokens/s, the
median per-prompt ratio to plain constrained decoding, mean accepted
length, and the host's mask work per cycle (advance, mask, roll back of the
K + 1 positions; `BatchedDecodeResult.mask_s` / cycles) next to the whole
cycle's time.

Run: python bench/scripts/constrained_decode.py [--model FOLDER] [--depth 1,2,3] [--tokens 96]
     [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import json
import platform
import statistics

import mlx.core as mx

from mtplx_ext.decode.constraint import GrammarVocab
from mtplx_ext.shipped import BENCH_PROMPTS, SHIPPED_MODEL, eos_ids
from mtplx_ext.benchmark.provenance import provenance

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "version": {"type": "integer"},
        "enabled": {"type": "boolean"},
        "mode": {"enum": ["fast", "safe", "debug"]},
        "paths": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"user": {"type": "string", "maxLength": 12},
                                                   "id": {"type": "integer"}},
                  "required": ["user", "id"], "additionalProperties": False},
    },
    "required": ["name", "version", "enabled", "mode", "paths", "owner"],
    "additionalProperties": False,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--depth", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rt = mtplx_ext.load(args.model)
    eos = list(eos_ids(rt.tokenizer))
    gv = GrammarVocab(rt.tokenizer, rt.vocab_size, eos)
    prompts = [rt.tokenizer.encode(p).ids for p in BENCH_PROMPTS[: args.prompts]]
    depths = [int(d) for d in args.depth.split(",")]
    methods = [("plain+json", 0), *[(f"k{d}+json", d) for d in depths], ("plain", 0), (f"k{depths[-1]}", depths[-1])]
    runs: dict[str, list[list]] = {m: [] for m, _ in methods}
    for rep in range(args.repeats + 1):
        for m, d in methods:
            per_prompt = []
            for p in prompts:
                cons = [gv.json_schema(SCHEMA)] if m.endswith("+json") else None
                r = mtplx_ext.generate_batched(rt, [p], max_new_tokens=args.tokens, use_mtp_draft=d > 0, depth=max(d, 1),
                                               stop_token_ids=eos, constraints=cons)
                per_prompt.append(r)
            if rep:
                runs[m].append(per_prompt)
    base = runs["plain+json"]
    out = {"model": args.model, "mlx": mx.__version__, "machine": platform.machine(), "tokens": args.tokens,
           "prompts": args.prompts, "repeats": args.repeats, "methods": {}, "provenance": provenance([args.model])}
    print(f"model {args.model}, batch 1, greedy, {args.prompts} prompts x {args.repeats} repeats, medians")
    print(f"{'method':>10s} {'tok/s':>8s} {'x plain+json':>12s} {'accepted/cycle':>14s} {'ms/cycle':>9s} {'mask ms/cycle':>13s}")
    for m, _ in methods:
        rs = runs[m]
        tps = statistics.median(sum(r.generated_tokens for r in rep) / sum(r.decode_s for r in rep) for rep in rs)
        ratio = statistics.median(
            (r.generated_tokens / r.decode_s) / (q.generated_tokens / q.decode_s)
            for rep, qrep in zip(rs, base) for r, q in zip(rep, qrep)
        )
        cycles = [r.cycles for rep in rs for r in rep]
        cyc_ms = statistics.median(r.decode_s / max(r.cycles, 1) * 1e3 for rep in rs for r in rep)
        mask_ms = statistics.median(r.mask_s / max(r.cycles, 1) * 1e3 for rep in rs for r in rep)
        acc = statistics.mean(r.mean_accepted_length for rep in rs for r in rep)
        out["methods"][m] = {"tokens_per_s": tps, "x_plain_json": ratio, "mean_accepted_length": acc,
                             "ms_per_cycle": cyc_ms, "mask_ms_per_cycle": mask_ms, "cycles": sum(cycles)}
        print(f"{m:>10s} {tps:8.1f} {ratio:12.2f} {acc:14.2f} {cyc_ms:9.2f} {mask_ms:13.3f}")
    sample = runs["k%d+json" % depths[-1]][0][0].streams[0].tokens
    print("sample:", repr(rt.tokenizer.decode([t for t in sample if t not in eos])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
