"""Compiled decode steps against eager ones, side by side, on the shipped model.

For each batch size, decoding mode (plain, MTP) and sampler (greedy,
temperature 0.8 with top-p 0.95), decodes the bench prompts with
`enforce_eager=False` and `enforce_eager=True` back to back in each round;
reports medians of tokens/s and of the per-round ratio compiled / eager.
Every run is checked to produce the same tokens in both modes.

Run: python bench/scripts/compiled_vs_eager.py [--batch 1,8] [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import statistics

from mtplx_ext.shipped import BENCH_PROMPTS, SHIPPED_MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rt = mtplx_ext.load(SHIPPED_MODEL)
    samplers = {"greedy": None, "T=0.8 top-p 0.95": mtplx_ext.SamplerConfig(temperature=0.8, top_p=0.95)}
    print("| batch | decoding | sampler | eager tokens/s | compiled tokens/s | compiled / eager | same tokens |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = [rt.tokenizer.encode(p).ids for p in BENCH_PROMPTS[:batch]]
        for mtp in (False, True):
            for name, sampler in samplers.items():
                tps = {True: [], False: []}
                same = True
                for r in range(args.rounds + 1):  # round 0 warms up (traces, kernels)
                    outs = {}
                    for eager in (True, False):
                        res = mtplx_ext.generate_batched(
                            rt, prompts, max_new_tokens=args.tokens, sampler=sampler, seed=r,
                            use_mtp_draft=mtp, enforce_eager=eager, depth=1,
                        )
                        assert res.compiled != eager
                        outs[eager] = [s.tokens for s in res.streams]
                        if r:
                            tps[eager].append(res.tokens_per_s)
                    same &= outs[True] == outs[False]
                ratio = statistics.median(c / e for c, e in zip(tps[False], tps[True]))
                print(
                    f"| {batch} | {'MTP' if mtp else 'plain'} | {name} | {statistics.median(tps[True]):.1f} | "
                    f"{statistics.median(tps[False]):.1f} | {ratio:.2f} | {'yes' if same else 'NO'} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
