"""Decode-shape GEMMs over a model's real weights: the shim's kernels against OpenBLAS.

One pass is every Linear weight of the trunk (attention, MLP, lm_head), each
multiplied once by an [M, in] activation as `x @ W.T`, in layer order, the
products a plain step (M = batch) or a verification (M = batch x (K + 1))
asks for. Each pass runs under every setting, interleaved per repeat so a
noisy neighbour hits them alike; medians of the repeats:

* packed 2t: the packed GEMM over weights packed once (`mtplx_ext.ops.linear`,
  what a loaded model runs on the CPU), large weights split over 2 threads;
* packed 1t: the same on one thread (`set_cpu_threads(1)`);
* decode 2t: the BLAS shim's decode GEMM over the row-major weights, large
  weights split over 2 threads;
* decode 1t: the shim's decode GEMM on one thread (`set_gemm_split_bytes(None)`);
* openblas: every product through OpenBLAS's sgemm.

Besides the wall-time medians it prints each setting's least process CPU
time per pass: on a machine shared with other work, the kernel's own cost.

It also prints the compute roof of each row count: 2 M P flops over the
weights' P parameters at the FMA peak of every core (`fma_peak.py`,
measured by the same run), and the least [M, h] / [1, h] ratio that roof
allows against this run's one-row pass: no float32 kernel can go below it.

The same run measures this machine's read bandwidth (`benchmark.read_bandwidth`: NumPy max
reductions over 1 GiB on every core at once, before and after the passes) and prints the weight-streaming
floor (weight bytes / bandwidth) beside the passes.

With --split: single products [M, K] x [N, K] over a range of weight sizes,
one thread against two, to place the decode GEMM's split threshold.

Run: python bench/scripts/decode_gemm.py --model GROWN [--rows 1,8,32,64] [--repeats 7] [--json OUT]
     python bench/scripts/decode_gemm.py --split [--rows 1,8] [--repeats 15]
"""

from __future__ import annotations

import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtplx_ext import _blas
from mtplx_ext.ops.linear import pack_linear_weight, packed_linear
from mtplx_ext.ops.threads import set_cpu_threads
from mtplx_ext.benchmark.bandwidth import read_bandwidth, streaming_floor_s
from mtplx_ext.benchmark.provenance import provenance

import fma_peak  # (this folder)

SETTINGS = ("packed 2t", "packed 1t", "decode 2t", "decode 1t", "openblas")


def apply(setting: str, split_bytes: int | None) -> None:
    """Routes decode-sized products as `setting` says."""
    _blas.set_small_gemm_rows(0 if setting == "openblas" else 64)
    _blas.set_gemm_kernel("decode")
    _blas.set_gemm_split_bytes(None if setting == "decode 1t" else split_bytes)
    set_cpu_threads(1 if setting == "packed 1t" else 0)


def trunk_weights(folder: Path) -> list[mx.array]:
    """The trunk's 2-D Linear weights (and lm_head) in file order; the embedding is a lookup, not a GEMM."""
    weights: list[mx.array] = []
    for shard in sorted(folder.glob("model*.safetensors")):
        for name, w in mx.load(str(shard)).items():
            if w.ndim == 2 and "embed_tokens" not in name and w.dtype == mx.float32:
                weights.append(w)
    if not weights:
        raise SystemExit(f"{folder}: no float32 2-D weights in model*.safetensors")
    mx.eval(weights)
    return weights


def passes(weights: list[mx.array], rows: list[int], repeats: int, split_bytes: int | None) -> dict:
    xs = {(m, k): mx.random.normal((m, k)) for m in rows for k in {int(w.shape[1]) for w in weights}}
    packed = [(pack_linear_weight(w), int(w.shape[0])) for w in weights]
    mx.eval(list(xs.values()), [p for p, _ in packed])
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for rep in range(repeats + 1):  # repeat 0 warms up
        for m in rows:
            for s in SETTINGS:
                apply(s, split_bytes)
                t0, c0 = time.perf_counter(), time.process_time()
                if s.startswith("packed"):
                    for wp, n in packed:
                        mx.eval(packed_linear(xs[m, int(wp.shape[1])], wp, n))
                else:
                    for w in weights:  # one product at a time, as a forward runs them
                        mx.eval(xs[m, int(w.shape[1])] @ w.T)
                if rep:
                    times.setdefault((s, m), []).append(time.perf_counter() - t0)
                    cpu.setdefault((s, m), []).append(time.process_time() - c0)
    apply("packed 2t", split_bytes)
    return {k: statistics.median(v) for k, v in times.items()}, {k: min(v) for k, v in cpu.items()}


def split_sweep(rows: list[int], repeats: int) -> None:
    prev = _blas.set_gemm_split_bytes(None)
    print("| M | N x K | W MiB | 1 thread us | 2 threads us | 1t / 2t |")
    print("|---:|---|---:|---:|---:|---:|")
    k = 1536
    for n in (24, 48, 96, 192, 384, 768, 1536, 4608):
        # Enough distinct weights that they do not all fit in the last-level cache.
        copies = max(2, int(96 * 2**20 // (n * k * 4)))
        ws = [mx.random.normal((n, k)) for _ in range(min(copies, 64))]
        mx.eval(ws)
        for m in rows:
            x = mx.random.normal((m, k))
            mx.eval(x)
            t: dict[str, list[float]] = {"1t": [], "2t": []}
            for rep in range(repeats + 1):
                for name, split in (("1t", None), ("2t", 0)):
                    _blas.set_gemm_split_bytes(split)
                    t0 = time.perf_counter()
                    for w in ws:
                        mx.eval(x @ w.T)
                    if rep:
                        t[name].append((time.perf_counter() - t0) / len(ws))
            a, b = (statistics.median(t[s]) * 1e6 for s in ("1t", "2t"))
            print(f"| {m} | {n} x {k} | {n * k * 4 / 2**20:.2f} | {a:.1f} | {b:.1f} | {a / b:.2f} |", flush=True)
    _blas.set_gemm_split_bytes(prev)


def compute_rate(repeats: int = 5, n: int = 1536) -> float:
    """FLOP/s of one core on a large float32 product (OpenBLAS's sgemm, one thread: [n, n] x [n, n]).

    The rate of a tuned compute-bound GEMM, as OpenBLAS builds it for this
    CPU (its kernel may use narrower vectors than the CPU has: the FMA peak
    itself is `bench/scripts/fma_peak.py`'s); M rows over P parameters at
    this rate take 2 M P / (cores x rate) seconds.
    """
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b)
    mx.eval(a @ b.T)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(a @ b.T)
        ts.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model folder (float32), e.g. one made by mtplx-ext grow")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--split", action="store_true", help="place the two-thread threshold instead")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not _blas.status().active:
        raise SystemExit(f"the BLAS shim is not active: {_blas.status().reason}")
    print(f"BLAS: {_blas.describe()}; load average {os.getloadavg()}")
    if args.split:
        split_sweep(rows, args.repeats)
        return
    if args.model is None:
        raise SystemExit("--model is required (a float32 model folder)")
    split_bytes = _blas.set_gemm_split_bytes(None)
    _blas.set_gemm_split_bytes(split_bytes)
    weights = trunk_weights(args.model)
    nbytes = sum(w.nbytes for w in weights)
    bw0 = read_bandwidth()
    med, cpu = passes(weights, rows, args.repeats, split_bytes)
    bw1 = read_bandwidth()
    bw = statistics.median([bw0, bw1])
    floor = streaming_floor_s(nbytes, bw)
    rate = compute_rate()
    peak = max(fma_peak.measure(50_000_000).items())[1]  # every core at once
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    print(f"OpenBLAS sgemm: {rate / 1e9:.0f} GFLOP/s on one core; at that rate on every core [M, h] products over "
          f"these weights take " + ", ".join(f"M={m}: {2 * m * nbytes / 4 / (cores * rate) * 1e3:.1f} ms" for m in rows) +
          f" on {cores} cores")
    print(f"{len(weights)} weights, {nbytes / 1e9:.3f} GB; read bandwidth {bw0 / 1e9:.1f} / {bw1 / 1e9:.1f} GB/s "
          f"(before / after); streaming floor {floor * 1e3:.1f} ms; medians of {args.repeats} interleaved passes; "
          f"load average after {os.getloadavg()}")
    print(f"FMA peak of every core at once: {peak / 1e9:.0f} GFLOP/s (fma_peak.py, this run)")
    print("| M | " + " | ".join(f"{s} ms" for s in SETTINGS) + " | packed 2t / floor | packed 2t / [1] | "
          "decode 2t / packed 2t | openblas / packed 2t | packed 2t GFLOP/s | FMA roof ms | least / [1] |")
    print("|---:|" + "---:|" * (len(SETTINGS) + 7))
    for m in rows:
        v = [med[s, m] * 1e3 for s in SETTINGS]
        print(f"| {m} | " + " | ".join(f"{x:.1f}" for x in v) + f" | {v[0] / (floor * 1e3):.2f} | "
              f"{med['packed 2t', m] / med['packed 2t', rows[0]]:.2f} | {v[2] / v[0]:.2f} | {v[4] / v[0]:.2f} | "
              f"{2 * m * nbytes / 4 / med['packed 2t', m] / 1e9:.0f} | {2 * m * nbytes / 4 / peak * 1e3:.1f} | "
              f"{max(1.0, 2 * m * nbytes / 4 / peak / med['packed 2t', rows[0]]):.2f} |")
    # CPU time counts only the time this process ran, not the time other
    # processes held its core: on a loaded machine, the closer measure of a
    # kernel's own cost (it counts both threads of "decode 2t").
    print("\nprocess CPU time per pass, least of the repeats (ms):")
    print("| M | " + " | ".join(SETTINGS) + " | packed 1t / [1] |")
    print("|---:|" + "---:|" * (len(SETTINGS) + 1))
    for m in rows:
        print(f"| {m} | " + " | ".join(f"{cpu[s, m] * 1e3:.1f}" for s in SETTINGS) +
              f" | {cpu['packed 1t', m] / cpu['packed 1t', rows[0]]:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "python bench/scripts/decode_gemm.py " + " ".join(f"--{k} {v}" for k, v in
                                                                      (("rows", args.rows), ("repeats", args.repeats))),
            "model": str(args.model.name), "weights": len(weights), "weight_bytes": nbytes,
            "blas": _blas.describe(), "mlx": mx.__version__, "cpu": platform.processor() or platform.machine(),
            "read_bandwidth": [bw0, bw1], "floor_s": floor, "sgemm_flops_one_core": rate, "fma_peak_flops": peak, "cores": cores, "split_bytes": split_bytes,
            "median_pass_s": {f"{s}|{m}": med[s, m] for s in SETTINGS for m in rows},
            "least_cpu_s": {f"{s}|{m}": cpu[s, m] for s in SETTINGS for m in rows},
            "load_average_after": os.getloadavg(), "provenance": provenance([args.model]),
        }, indent=1))


if __name__ == "__main__":
    main()
