"""Quantized models on the CPU's quantized GEMM: prefill, plain decoding and MTP, side by side with float32.

For each model folder (`--models`, e.g. the grown float32 model and its
`mtplx-ext convert -q` conversions) in one process, interleaved per repeat:
  * prefill: seconds the decode loop takes to prefill one held-out prompt
    of `--prompt-tokens` tokens (`BatchedDecodeResult.prefill_s`);
  * decoding: greedy tokens/s of plain decoding and of MTP at each depth in
    `--depths` (and "auto"), at each batch size in `--batch`, on held-out
    prompts (`benchmark.heldout_prompts`); every MTP decode is checked to
    commit exactly the plain decode's tokens;
  * the linears alone: one pass over every packed layer at 1 and K + 1 rows
    against the weight-streaming floor (bytes / this machine's read rate,
    measured in the same run).
Prints medians and ratios (MTP / plain of the same model, quantized / float32
prefill) and writes `--json`.

Run: python bench/scripts/quantized_cpu.py --models /tmp/m/grown,/tmp/m/grown-q8,/tmp/m/grown-q4
     [--batch 1,8] [--depths 1,2,3,4] [--tokens 64] [--prompt-tokens 128] [--repeats 3] [--prefill-only]
     [--json OUT]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import mlx.core as mx

from mtplx_ext.benchmark import bandwidth, harness
from mtplx_ext.models.packed_linear import PackedLinear
from mtplx_ext.models.packed_quantized import PackedQuantizedLinear
from mtplx_ext.benchmark.provenance import provenance


def prefill_s(rt, prompt: list[int]) -> float:
    """The decode loop's prefill of one prompt (its own timer: the trunk over the prompt, fused attention)."""
    return mtplx_ext.generate_greedy_batched(rt, [prompt], max_new_tokens=1, use_mtp_draft=False).prefill_s


def decode(rt, prompts, tokens: int, depth) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    r = mtplx_ext.generate_greedy_batched(
        rt, prompts, max_new_tokens=tokens, use_mtp_draft=depth != 0, depth=depth or 1
    )
    wall = time.perf_counter() - t0
    out = [s.tokens for s in r.streams]
    return sum(len(t) for t in out) / wall, out


def linears_pass_s(rt, rows: int) -> float:
    mods = [m for m in rt.trunk.modules() if isinstance(m, (PackedLinear, PackedQuantizedLinear))]
    xs = {m.input_dims: mx.random.normal((rows, m.input_dims)) for m in mods}
    mx.eval(list(xs.values()))
    t0 = time.perf_counter()
    mx.eval([m(xs[m.input_dims]) for m in mods])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True, help="comma-separated model folders")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-only", action="store_true", help="time the prefill and the layers only")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    folders = a.models.split(",")
    batches = [] if a.prefill_only else [int(b) for b in a.batch.split(",")]
    depths = [0] + [d if d == "auto" else int(d) for d in a.depths.split(",")] + ["auto"]
    depths = list(dict.fromkeys(depths))
    rts = {f: mtplx_ext.load(f) for f in folders}
    tok = next(iter(rts.values())).tokenizer
    prompts = harness.heldout_prompts(tok, 8, 32, seed=3)
    long_prompt = harness.heldout_prompts(tok, 1, a.prompt_tokens, seed=4)[0]
    read = bandwidth.read_bandwidth()
    res: dict = {f: {"prefill_s": [], "decode": {}, "linears": {}} for f in folders}
    for f, rt in rts.items():  # warm-up: compile, calibrate "auto", first-touch the weights
        prefill_s(rt, long_prompt)
        for b in batches:
            for d in depths:
                decode(rt, prompts[:b], 8, d)
    for rep in range(a.repeats):
        for f, rt in rts.items():
            res[f]["prefill_s"].append(prefill_s(rt, long_prompt))
            for b in batches:
                plain = None
                for d in depths:
                    tps, toks = decode(rt, prompts[:b], a.tokens, d)
                    if d == 0:
                        plain = toks
                    elif toks != plain:
                        raise SystemExit(f"{f}: depth {d} batch {b} committed other tokens than plain decoding")
                    res[f]["decode"].setdefault(f"b{b}", {}).setdefault(str(d), []).append(tps)
            for rows in (1, 4):
                res[f]["linears"].setdefault(str(rows), []).append(linears_pass_s(rt, rows))
    med = statistics.median
    ref = folders[0]
    report = {"command": " ".join(["python", "bench/scripts/quantized_cpu.py", *__import__("sys").argv[1:]]),
              "mlx": mx.__version__, "machine": platform.processor() or platform.machine(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "read_bandwidth_GBs": read / 1e9, "prompt_tokens": len(long_prompt), "models": {}}
    for f, rt in rts.items():
        nbytes = bandwidth.weight_bytes(rt.trunk)
        r = res[f]
        m = {"weight_MB": nbytes / 1e6, "floor_ms": 1e3 * bandwidth.streaming_floor_s(nbytes, read),
             "prefill_s": med(r["prefill_s"]), "prefill_vs_first": med(res[ref]["prefill_s"]) / med(r["prefill_s"]),
             "linears_ms": {k: 1e3 * med(v) for k, v in r["linears"].items()}, "decode": {}}
        print(f"{f}: {m['weight_MB']:.0f} MB, floor {m['floor_ms']:.2f} ms; prefill {len(long_prompt)} tokens "
              f"{m['prefill_s'] * 1e3:.0f} ms ({m['prefill_vs_first']:.2f}x {Path(ref).name}); linears "
              + ", ".join(f"{k} rows {v:.2f} ms" for k, v in m["linears_ms"].items()))
        for b, per in r["decode"].items():
            plain = med(per["0"])
            m["decode"][b] = {d: {"tok_s": med(v), "vs_plain": med(v) / plain, "runs": v} for d, v in per.items()}
            print(f"  {b}: " + ", ".join(f"{'plain' if d == '0' else 'K=' + d} {med(v):.1f} tok/s ({med(v) / plain:.2f}x)"
                                         for d, v in per.items()))
        report["models"][f] = m
    if a.json:
        report["provenance"] = provenance(folders)
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
