"""The shipped model converted to 8 and 4 bits vs float32 and bfloat16, in one run.

    PYTHONPATH=python python bench/scripts/quantized_checkpoints.py [--json out.json] [--repeats 3]

For each variant: file size, held-out greedy acceptance (`train`'s held-out
split, `train.heldout_decode_acceptance`: the batch of 8 and the mean of the
8 single-stream decodes) and tokens/s of plain and MTP decoding at batch 1
and 8 (the bench prompts, medians of interleaved repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import mtplx_ext
from mtplx_ext import train
from mtplx_ext.checkpoints import convert
from mtplx_ext.shipped import BENCH_PROMPTS, EOS_TOKEN, SHIPPED_MODEL
from mtplx_ext import benchmark
from mtplx_ext.benchmark.provenance import provenance

#: name -> convert keyword arguments.
VARIANTS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "8-bit": {"quantize": True, "q_bits": 8},
    "4-bit": {"quantize": True, "q_bits": 4},
    "4-bit, float fc": {"quantize": True, "q_bits": 4, "keep_fusion_float": True},
    "4-bit, 8-bit head": {"quantize": True, "q_bits": 4, "mtp_bits": 8},
    "4-bit, float head": {"quantize": True, "q_bits": 4, "mtp_bits": None},
}


def heldout_tokens(tok):
    root = train.stdlib_root()
    _, held = train.split_files(train.stdlib_files(root), root)
    return train.encode_files(tok, held)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--only", nargs="*", help="variant names")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    names = args.only or list(VARIANTS)
    rts = {}
    rows = {}
    for name in names:
        folder = tmp / name.replace(" ", "_").replace(",", "")
        convert.convert(SHIPPED_MODEL, folder, **VARIANTS[name])
        rts[name] = mtplx_ext.load(folder)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        rows[name] = {"variant": name, "bytes": size, "bits_per_weight": convert.bits_per_weight(rts[name])}
    tok = rts[names[0]].tokenizer
    held = heldout_tokens(tok)
    eos = tok.token_to_id(EOS_TOKEN)
    for name in names:
        rows[name]["heldout"] = train.heldout_decode_acceptance(rts[name], held, eos)
    prompts = benchmark.encode_prompts(tok, list(BENCH_PROMPTS))
    for b in (1, 8):
        groups = benchmark.prompt_groups(prompts, b)
        runs = {(n, m): [] for n in names for m in (True, False)}
        for rep in range(args.repeats + 1):  # first round warms up
            for n in names:
                for mtp in (True, False):
                    r = benchmark.combined_runs([benchmark.engine_run(rts[n], g, args.tokens, mtp) for g in groups])
                    if rep:
                        runs[n, mtp].append(r)
        for n in names:
            rows[n][f"b{b}_mtp_tps"] = statistics.median(r.tokens_per_s for r in runs[n, True])
            rows[n][f"b{b}_plain_tps"] = statistics.median(r.tokens_per_s for r in runs[n, False])
            rows[n][f"b{b}_acceptance"] = statistics.median(r.acceptance for r in runs[n, True])
    print("| variant | MB | bits/weight | held-out acc. batch | single mean | "
          "b1 plain | b1 MTP | b1 x | b8 plain | b8 MTP | b8 x |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        r = rows[n]
        h = r["heldout"]
        print(
            f"| {n} | {r['bytes'] / 2**20:.1f} | {r['bits_per_weight']:.2f} | {h['acceptance_batch']:.3f} | "
            f"{h['acceptance_single_mean']:.3f} | {r['b1_plain_tps']:.0f} | {r['b1_mtp_tps']:.0f} | "
            f"{r['b1_mtp_tps'] / r['b1_plain_tps']:.2f} | {r['b8_plain_tps']:.0f} | {r['b8_mtp_tps']:.0f} | "
            f"{r['b8_mtp_tps'] / r['b8_plain_tps']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": list(rows.values()), "versions": benchmark.versions(),
                                               "provenance": provenance([None])}, indent=2) + "\n")


if __name__ == "__main__":
    main()
