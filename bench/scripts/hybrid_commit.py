"""Hybrid trunks: per-stream commit against uniform full-batch repair, side by side.

A trained hybrid model (GatedDeltaNet trunk + MTP head; default
bench/models/tiny-qwen3-next-mtp), held-out prompts cut from Python stdlib files
it was not trained on, greedy, compiled steps. Per repeat, interleaved:
plain decoding, and at each depth MTP with `reject_mode="repair"` (each
stream commits at its own accepted length from the recurrent states
captured at every verified position: no repair forward) and with
`reject_mode="reforward"` (the whole batch restores its snapshot and
re-forwards whenever a stream going on rejected). Medians over repeats.

forwards/token is per stream: cycles' forwards over the tokens one stream
commits; 1 / (1 + L) is its floor when every cycle is one forward (L: mean
accepted length). A fixed batch runs until its slowest stream is done, so
the next column counts each stream's own cycles only (what a batch that
evicts finished streams, `mtplx_ext.Engine`, pays).

Run: python bench/scripts/hybrid_commit.py [--model DIR] [--batch 1,8] [--depth 1,2,3] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import statistics
from pathlib import Path

from mtplx_ext import _blas
from mtplx_ext import benchmark

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-next-mtp"


def run(rt, groups, n: int, mtp: bool = True, depth: int = 1, reject_mode: str = "repair") -> dict:
    r = benchmark.combined_runs([benchmark.engine_run(rt, g, n, mtp, depth=depth, reject_mode=reject_mode) for g in groups])
    return {"tps": r.tokens_per_s, "fpt": r.forwards_per_token, "L": r.accepted / max(1, r.stream_cycles),
            # each stream's own cycles (a finished stream's later cycles left out)
            "fpt_live": r.stream_cycles / max(1, r.tokens),
            "repairs": r.repair_cycles, "cycles": r.cycles, "out": r.outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--depth", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rt = mtplx_ext.load(args.model)
    prompts = benchmark.heldout_prompts(rt.tokenizer, args.prompts, 48, seed=0)
    depths = [int(d) for d in args.depth.split(",")]
    print(f"BLAS: {_blas.describe()}; {args.prompts} held-out prompts, {args.tokens} new tokens, "
          f"medians of {args.repeats} interleaved repeats")
    print("| batch | depth | per-stream tokens/s | reforward tokens/s | per-stream / reforward | x plain (per-stream) "
          "| forwards/token per-stream | same, each stream's own cycles | 1 / (1 + L) | forwards/token reforward "
          "| repair cycles (reforward) "
          "| same tokens as plain |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in (int(x) for x in args.batch.split(",")):
        groups = benchmark.prompt_groups(prompts, b)
        res: dict = {}
        for rep in range(args.repeats + 1):
            rows = {"plain": run(rt, groups, args.tokens, mtp=False)}
            for d in depths:
                for mode in ("repair", "reforward"):
                    rows[d, mode] = run(rt, groups, args.tokens, depth=d, reject_mode=mode)
            if rep:
                for k, v in rows.items():
                    res.setdefault(k, []).append(v)
        med = lambda k, f: statistics.median(r[f] for r in res[k])  # noqa: E731
        for d in depths:
            ps, rf = (d, "repair"), (d, "reforward")
            ratio = statistics.median(a["tps"] / c["tps"] for a, c in zip(res[ps], res[rf]))
            xplain = statistics.median(a["tps"] / c["tps"] for a, c in zip(res[ps], res["plain"]))
            same = sum(x == y for x, y in zip(res[ps][0]["out"], res["plain"][0]["out"]))
            print(f"| {b} | {d} | {med(ps, 'tps'):.1f} | {med(rf, 'tps'):.1f} | {ratio:.2f} | {xplain:.2f} | "
                  f"{med(ps, 'fpt'):.3f} | {med(ps, 'fpt_live'):.3f} | {1 / (1 + med(ps, 'L')):.3f} | {med(rf, 'fpt'):.3f} | "
                  f"{med(rf, 'repairs'):.0f} of {med(rf, 'cycles'):.0f} | {same}/{len(res['plain'][0]['out'])} |",
                  flush=True)


if __name__ == "__main__":
    main()
