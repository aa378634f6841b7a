"""Timed decodes for `mtplx-ext bench` and the scripts in bench/.

A `Run` is one timed greedy decode (tokens over all streams, seconds after
the first token, raw acceptance counts so that runs combine); `engine_run`
decodes with this package, `mlx_lm_run` with mlx-lm itself (the peer
baseline); `run_bench` interleaves methods per repeat and reports medians
and paired ratios; `heldout_prompts` cuts prompts from files the shipped
model never saw.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mtplx_ext import _blas
from mtplx_ext.benchmark.bandwidth import read_bandwidth, streaming_floor_s, weight_bytes
from mtplx_ext.batching import generate_batched
from mtplx_ext.shipped import BENCH_PROMPTS
from mtplx_ext.train import corpus


def md_version(dist: str) -> str:
    """An installed distribution's version, or "not installed"."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def encode_prompts(tok: Any, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt (ValueError naming one that encodes to none)."""
    ids = [tok.encode(p).ids for p in prompts]
    for p, t in zip(prompts, ids):
        if not t:
            raise ValueError(f"prompt {p!r} encodes to no tokens")
    return ids


@dataclass
class Run:
    """One timed decode: tokens over all streams and seconds after the first token."""

    tokens: int
    seconds: float
    acceptance: float | None = None
    forwards_per_token: float | None = None
    outputs: list[list[int]] = field(default_factory=list)
    # Raw counts, so that runs over several groups of prompts combine.
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    stream_tokens: float = 0.0
    compiled: bool | None = None  # engine runs: whether steps ran through mx.compile
    reached: list[int] = field(default_factory=list)  # per draft position (MTP runs)
    accepted_at: list[int] = field(default_factory=list)
    stream_cycles: int = 0  # cycles summed over the streams each was live in
    cycles: int = 0
    row_cycles: int = 0  # rows of the batch summed over the cycles (fewer once a batch drops finished rows)
    repair_cycles: int = 0
    depths: list[int] = field(default_factory=list)  # the depth each decode ran at (0: plain)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def engine_run(
    rt: Any,
    prompts: list[list[int]],
    n: int,
    mtp: bool,
    enforce_eager: bool = False,
    depth: int | str = 1,
    reject_mode: str = "repair",
    compact_rows: bool = True,
) -> Run:
    """One greedy decode of `prompts` as one batch, timed (the benches' unit of work); depth may be "auto"."""
    r = generate_batched(
        rt, prompts, max_new_tokens=n, use_mtp_draft=mtp, enforce_eager=enforce_eager, depth=depth,
        reject_mode=reject_mode, compact_rows=compact_rows,
    )
    per_stream = r.generated_tokens / len(prompts)
    return Run(
        tokens=r.generated_tokens,
        seconds=r.decode_s,
        acceptance=r.acceptance_rate if mtp else None,
        forwards_per_token=r.forwards / per_stream,
        outputs=[s.tokens for s in r.streams],
        drafted=r.drafted,
        accepted=r.accepted,
        forwards=r.forwards,
        stream_tokens=per_stream,
        compiled=r.compiled,
        reached=list(r.reached),
        accepted_at=list(r.accepted_at),
        stream_cycles=r.stream_cycles,
        cycles=r.cycles,
        row_cycles=r.row_cycles,
        repair_cycles=r.repair_cycles,
        depths=[r.depth],
    )


def prompt_groups(prompt_ids: list[list[int]], batch: int) -> list[list[list[int]]]:
    """Every bench prompt at least once, in batches of `batch` streams.

    Each batch size decodes the same prompts (repeated to fill the last
    batch), so batch 1 is not one prompt's luck.
    """
    n = -(-max(batch, len(prompt_ids)) // batch) * batch
    streams = [prompt_ids[i % len(prompt_ids)] for i in range(n)]
    return [streams[i : i + batch] for i in range(0, n, batch)]


def combined_runs(runs: list[Run]) -> Run:
    """One Run for consecutive decodes of several prompt groups."""
    engine = all(r.forwards_per_token is not None for r in runs)
    drafted = sum(r.drafted for r in runs)
    stream_tokens = sum(r.stream_tokens for r in runs)
    return Run(
        tokens=sum(r.tokens for r in runs),
        seconds=sum(r.seconds for r in runs),
        acceptance=(sum(r.accepted for r in runs) / drafted if drafted else 0.0)
        if all(r.acceptance is not None for r in runs)
        else None,
        forwards_per_token=sum(r.forwards for r in runs) / stream_tokens if engine and stream_tokens else None,
        outputs=[o for r in runs for o in r.outputs],
        drafted=drafted,
        accepted=sum(r.accepted for r in runs),
        forwards=sum(r.forwards for r in runs),
        stream_tokens=stream_tokens,
        compiled=all(r.compiled for r in runs) if engine else None,
        reached=[sum(c) for c in zip(*(r.reached for r in runs))],
        accepted_at=[sum(c) for c in zip(*(r.accepted_at for r in runs))],
        stream_cycles=sum(r.stream_cycles for r in runs),
        cycles=sum(r.cycles for r in runs),
        row_cycles=sum(r.row_cycles for r in runs),
        repair_cycles=sum(r.repair_cycles for r in runs),
        depths=[d for r in runs for d in r.depths],
    )


def mlx_lm_model(folder: Path) -> Any:
    """The model as mlx-lm itself loads it (its own modules; MTP weights dropped)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(folder, strict=False)
    return model


def mlx_lm_run(trunk: Any, prompts: list[list[int]], n: int) -> Run:
    """mlx-lm's own greedy generation of `trunk` (the peer baseline).

    Batch 1 uses `generate_step` (what `mlx_lm.generate` runs); larger batches
    `BatchGenerator` (what `mlx_lm.batch_generate` runs). Time counts from
    the first generated token, as the engine's decode time does.
    """
    from mlx_lm.generate import BatchGenerator, generate_step

    if len(prompts) == 1:
        out: list[int] = []
        t_first = None
        for tok, _ in generate_step(mx.array(prompts[0]), trunk, max_tokens=n):
            out.append(int(tok))
            if t_first is None:
                t_first = time.perf_counter()
        return Run(tokens=len(out), seconds=time.perf_counter() - t_first, outputs=[out])
    gen = BatchGenerator(trunk, max_tokens=n)
    uids = gen.insert(prompts, [n] * len(prompts))
    outs: dict[int, list[int]] = {u: [] for u in uids}
    t_first = None
    while responses := gen.next_generated():
        if t_first is None:
            t_first = time.perf_counter()
        for r in responses:
            outs[r.uid].append(int(r.token))
    seconds = time.perf_counter() - t_first
    gen.close()
    return Run(tokens=sum(len(v) for v in outs.values()), seconds=seconds, outputs=[outs[u] for u in uids])


METHODS = ("mtp", "plain", "mlx-lm")


def versions() -> dict[str, str]:
    def ver(d: str) -> str:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "mtplx-ext": md_version("mtplx-ext"),
        "mlx": ver("mlx"),
        "mlx-lm": ver("mlx-lm"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "blas": _blas.describe(),
    }


def run_bench(
    rt: Any,
    tok: Any,
    batches: list[int],
    n: int,
    repeats: int,
    progress: bool = True,
    baseline: Any = None,
    enforce_eager: bool = False,
    depths: list[int] | None = None,
    prompt_ids: list[list[int]] | None = None,
) -> dict:
    """All methods at all batch sizes, interleaved per repeat; medians of repeats.

    `baseline` is the model mlx-lm's generation runs (default: rt's trunk);
    give the one `mlx_lm_model` loads, so that it runs mlx-lm's own modules.
    `enforce_eager` keeps the engine's steps out of `mx.compile`. `depths`:
    one MTP method per depth, ints or "auto" ("mtp" alone for one
    depth; default ["auto"]). `prompt_ids`: the
    prompts (default: the bench's own openings).
    """
    baseline = rt.trunk if baseline is None else baseline
    prompt_ids = encode_prompts(tok, list(BENCH_PROMPTS)) if prompt_ids is None else prompt_ids
    depths = depths or ["auto"]
    runners: dict[str, Any] = {}
    for d in depths:
        name = "mtp" if len(depths) == 1 else (f"mtp-{d}" if d == "auto" else f"mtp-k{d}")
        runners[name] = lambda p, d=d: engine_run(rt, p, n, True, enforce_eager, d)
    runners["plain"] = lambda p: engine_run(rt, p, n, False, enforce_eager)
    runners["mlx-lm"] = lambda p: mlx_lm_run(baseline, p, n)
    methods = list(runners)
    total = len(batches) * len(methods) * (repeats + 1)
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr, leave=False)
        except ImportError:
            pass
    rows = []
    for b in batches:
        groups = prompt_groups(prompt_ids, b)
        runs: dict[str, list[Run]] = {m: [] for m in methods}
        # One untimed warm-up per method, then methods interleave per repeat so
        # that load changes on the machine hit all of them alike.
        for rep in range(repeats + 1):
            for m in methods:
                r = combined_runs([runners[m](g) for g in groups])
                if rep > 0:
                    runs[m].append(r)
                if bar is not None:
                    bar.set_postfix(batch=b, method=m, refresh=False)
                    bar.update(1)
        ref_out = runs["plain"][0].outputs
        for m in methods:
            rs = runs[m]
            tps = statistics.median(r.tokens_per_s for r in rs)
            acc = [r.acceptance for r in rs if r.acceptance is not None]
            fpt = [r.forwards_per_token for r in rs if r.forwards_per_token is not None]
            rows.append({
                "batch": b,
                "method": m,
                "tokens_per_s": tps,
                # Paired: each repeat ran the methods back to back, so the
                # per-repeat ratio cancels slow drifts of the machine.
                "ratio_to_plain": statistics.median(
                    r.tokens_per_s / q.tokens_per_s for r, q in zip(rs, runs["plain"]) if q.tokens_per_s > 0
                ),
                "acceptance_rate": statistics.median(acc) if acc else None,
                "forwards_per_token": statistics.median(fpt) if fpt else None,
                "streams_equal_to_plain": sum(a == c for a, c in zip(rs[0].outputs, ref_out)),
                "streams": len(ref_out),
                "compiled": rs[0].compiled,
                "depth": sorted(set(rs[0].depths)) if m != "mlx-lm" else [],
                "tokens_per_s_repeats": [r.tokens_per_s for r in rs],
                # Over all repeats: accepted / reached per draft position.
                "acceptance_per_depth": [
                    sum(r.accepted_at[i] for r in rs) / max(1, sum(r.reached[i] for r in rs))
                    for i in range(len(rs[0].reached))
                ],
                "mean_accepted_length": sum(r.accepted for r in rs) / max(1, sum(r.stream_cycles for r in rs)),
            })
    if bar is not None:
        bar.close()
    floor = streaming_floor(rt)
    return {
        "tokens": n,
        "repeats": repeats,
        "enforce_eager": bool(enforce_eager),
        "methods": methods,
        "prompts": len(prompt_ids),
        "rows": rows,
        "floor": floor,
        "versions": versions(),
    }


def streaming_floor(rt: Any) -> dict:
    """The model's weight-streaming floor on this machine, measured now: trunk bytes / read rate.

    The read buffer is twice the weights (at least 256 MiB, at most 1 GiB),
    so a small model is timed against the caches it lives in and a large one
    against memory.
    """
    nbytes = weight_bytes(rt)
    bw = read_bandwidth(min(max(2 * nbytes, 256 << 20), 1 << 30))
    return {"weight_bytes": nbytes, "read_bandwidth": bw, "floor_s": streaming_floor_s(nbytes, bw)}


def format_table(report: dict) -> str:
    """A Markdown table of a bench report."""
    engine = [r["compiled"] for r in report["rows"] if r.get("compiled") is not None]
    steps = "compiled (mx.compile)" if engine and all(engine) else "eager" if not any(engine) else "mixed"
    fl = report.get("floor")
    plain1 = [r for r in report["rows"] if r["method"] == "plain" and r["batch"] == 1]
    lines = [
        f"BLAS: {report['versions']['blas']}",
        *([f"weight-streaming floor: {fl['weight_bytes'] / 1e9:.3f} GB of trunk weights / "
           f"{fl['read_bandwidth'] / 1e9:.1f} GB/s read = {fl['floor_s'] * 1e3:.2f} ms per step"
           + (f"; plain batch-1 step {1e3 / plain1[0]['tokens_per_s']:.2f} ms "
              f"({1 / plain1[0]['tokens_per_s'] / fl['floor_s']:.2f}x the floor)" if plain1 else "")] if fl else []),
        f"engine decode steps: {steps}",
        f"{report['tokens']} new tokens per stream, median of {report['repeats']} repeats "
        "(x plain: median of the per-repeat ratios)",
        "",
        "| batch | method | K | tokens/s | x plain | acceptance | per depth | accepted length | forwards/token "
        "| same tokens as plain |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in report["rows"]:
        acc = r["acceptance_rate"]
        fpt = r["forwards_per_token"]
        per = r.get("acceptance_per_depth") or []
        mal = r.get("mean_accepted_length")
        depth = "/".join(map(str, r.get("depth") or []))
        lines.append(
            f"| {r['batch']} | {r['method']} | {depth} | {r['tokens_per_s']:.1f} | {r['ratio_to_plain']:.2f} | "
            f"{'' if acc is None else f'{acc:.2f}'} | {'/'.join(f'{a:.2f}' for a in per)} | "
            f"{'' if acc is None or mal is None else f'{mal:.2f}'} | {'' if fpt is None else f'{fpt:.2f}'} | "
            f"{r['streams_equal_to_plain']}/{r['streams']} |"
        )
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> str:
    """Bar chart of tokens/s per batch and method, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot skipped: matplotlib is not installed (pip install matplotlib); the table holds the numbers"
    batches = sorted({r["batch"] for r in report["rows"]})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    methods = report.get("methods", list(METHODS))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        vals = [next(r["tokens_per_s"] for r in report["rows"] if r["batch"] == b and r["method"] == m) for b in batches]
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(batches))]
        ax.bar(xs, vals, width, label=m)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("tokens/s (all streams)")
    ax.set_title(f"mtplx-ext bench, {report['tokens']} tokens; BLAS {_blas.status().name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def heldout_prompts(tok: Any, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens cut at random offsets from the held-out stdlib files.

    The shipped model never saw these files (`mtplx_ext.train.corpus`'s split), so
    acceptance on them is what a user's new text gets, not the training set's.
    """
    root = corpus.stdlib_root()
    _, held = corpus.split_files(corpus.stdlib_files(root), root)
    rng = np.random.default_rng(seed)
    texts = [corpus.read_text(p) for p in held]
    out = []
    for _ in range(100 * n):
        ids = tok.encode(texts[int(rng.integers(len(texts)))]).ids
        if len(ids) > 2 * length:
            s = int(rng.integers(0, len(ids) - length))
            out.append(ids[s : s + length])
        if len(out) == n:
            return out
    raise ValueError(f"could not cut {n} prompts of {length} tokens from the held-out files")
