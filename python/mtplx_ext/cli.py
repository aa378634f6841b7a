"""The `mtplx-ext` command: generate text with MTP decoding, or benchmark it.

    mtplx-ext generate "def parse(" --max-tokens 64
    mtplx-ext bench --batch 1,8 --tokens 128 --repeats 3 --json bench.json

Without --model both use the small model shipped inside the package.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The package import loads the fast BLAS before anything imports mlx.core.
import mtplx_ext
from mtplx_ext import _blas, sampling
from mtplx_ext._checks import SEED_LIMIT, as_int

import numpy as np

SHIPPED_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-qwen3-mtp"
EOS = "<|endoftext|>"

#: Prompts for `bench` (code, like the shipped model's training data); batch
#: B uses the first B, cycling.
BENCH_PROMPTS = (
    "def read_config(path):\n",
    "class Queue:\n    def __init__(self",
    "import os\nimport sys\n\n\ndef main(",
    "    for key, value in",
    "def _check_args(self, name",
    "try:\n    import",
    "    if not isinstance(",
    "class Error(Exception):\n",
)
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main("


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


# -- model -------------------------------------------------------------------


def load_model(path: str | None, need_mtp: bool) -> Any:
    """Loads a model folder (default: the shipped one) with one-line errors."""
    folder = Path(path) if path else SHIPPED_MODEL
    if not folder.exists():
        if path is None:
            raise CLIError(f"the shipped model is missing from this install ({folder}); reinstall mtplx-ext")
        raise CLIError(f"model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise CLIError(f"--model {str(folder)!r} is not a folder (give a Hugging Face-style model folder)")
    if not (folder / "config.json").is_file():
        raise CLIError(f"model folder {str(folder)!r} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise CLIError(f"model folder {str(folder)!r} has no *.safetensors weights")
    try:
        rt = mtplx_ext.load(folder)
    except (ValueError, KeyError, OSError, RuntimeError) as e:  # corrupt files: one line, never a traceback
        raise CLIError(f"cannot load model folder {str(folder)!r}: {e}") from e
    if need_mtp and not rt.has_mtp:
        raise CLIError(
            f"model folder {str(folder)!r} has no MTP head weights; use --no-mtp for plain decoding with it, "
            "or add the head with `mtplx-ext convert --mtp-from HF_FOLDER MLX_FOLDER OUT`"
        )
    return rt


def _tokenizer(rt: Any, folder: str | None) -> Any:
    if rt.tokenizer is None:
        raise CLIError(f"model folder {folder or str(SHIPPED_MODEL)!r} has no tokenizer.json to encode text prompts")
    return rt.tokenizer


def _stop_ids(tok: Any) -> list[int]:
    eos = tok.token_to_id(EOS)
    return [eos] if eos is not None else []


def _encode(tok: Any, prompts: list[str]) -> list[list[int]]:
    ids = [tok.encode(p).ids for p in prompts]
    for p, t in zip(prompts, ids):
        if not t:
            raise CLIError(f"prompt {p!r} encodes to no tokens")
    return ids


def _check_prompt_text(texts: list[str]) -> None:
    """Rejects prompts that are not UTF-8 (the tokenizer takes only valid text)."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            # Undecodable argv bytes arrive as lone surrogates (U+DC80..U+DCFF = byte 0x80..0xFF).
            c = ord(t[e.start])
            what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"character U+{c:04X}"
            raise CLIError(f"prompt {i} is not UTF-8 text: {what} at position {e.start}") from None


# -- streaming output --------------------------------------------------------


class StdoutError(CLIError):
    """Standard output cannot be written (closed, full, an I/O error)."""


class _Stdout:
    """sys.stdout whose write errors become one-line CLI errors.

    A broken pipe (the reader went away, as in `| head`) passes through as
    BrokenPipeError: `main` then exits quietly, as other Unix tools do.
    """

    def __init__(self) -> None:
        if sys.stdout is None:
            raise StdoutError("standard output is closed")
        self._out = sys.stdout

    def _guard(self, fn, *args) -> Any:
        try:
            return fn(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to standard output: {e.strerror or e}") from None

    def write(self, text: str) -> int:
        return self._guard(self._out.write, text)

    def flush(self) -> None:
        self._guard(self._out.flush)


def _drop_stdout() -> None:
    """Points fd 1 at the null device after a failed write to it.

    The interpreter flushes stdout once more at exit; that flush would fail
    again and print "Exception ignored" to stderr.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


class TextStreamer:
    """Prints committed tokens as text while decoding runs.

    One stream prints raw text; several streams print whole lines prefixed
    with the stream index, so their output does not interleave mid-line.
    """

    def __init__(self, tok: Any, n: int, out=None, header: str = ""):
        self.tok = tok
        self.header = header  # shown with the first committed tokens
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.printed = [0] * n  # characters of decoded text already shown
        self.out = out or sys.stdout
        self.multi = n > 1

    def _text(self, i: int) -> str:
        text = self.tok.decode(self.ids[i])
        # A byte-level token can end inside a UTF-8 character: hold it back.
        return text[:-1] if text.endswith("\ufffd") else text

    def _start(self) -> None:
        if self.header:
            self.out.write(self.header)
            self.header = ""

    def __call__(self, i: int, new: list[int]) -> None:
        self._start()
        self.ids[i].extend(new)
        text = self._text(i)
        if not self.multi:
            self.out.write(text[self.printed[i] :])
            self.printed[i] = len(text)
        else:
            end = text.rfind("\n") + 1
            if end > self.printed[i]:
                for line in text[self.printed[i] : end].splitlines():
                    self.out.write(f"[{i}] {line}\n")
                self.printed[i] = end
        self.out.flush()

    def finish(self) -> None:
        self._start()
        for i in range(len(self.ids)):
            rest = self.tok.decode(self.ids[i])[self.printed[i] :]
            if self.multi:
                for line in rest.splitlines():
                    self.out.write(f"[{i}] {line}\n")
            else:
                self.out.write(rest + "\n")
        self.out.flush()


# -- generate ----------------------------------------------------------------


def _decode(rt: Any, prompts: list[list[int]], args: argparse.Namespace, on_commit=None, stop=()) -> Any:
    if args.temperature > 0:
        sampler = mtplx_ext.SamplerConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        try:
            return mtplx_ext.generate_batched(
                rt, prompts, max_new_tokens=args.max_tokens, sampler=sampler, seed=args.seed,
                stop_token_ids=stop, use_mtp_draft=not args.no_mtp, on_commit=on_commit,
                enforce_eager=args.enforce_eager, depth=args.depth,
            )
        except NotImplementedError as e:
            raise CLIError(f"--temperature > 0 is not available in this build: {e}") from e
    return mtplx_ext.generate_greedy_batched(
        rt, prompts, max_new_tokens=args.max_tokens, stop_token_ids=stop,
        use_mtp_draft=not args.no_mtp, on_commit=on_commit, enforce_eager=args.enforce_eager, depth=args.depth,
    )


def mlx_kernel_cache_is_cold() -> bool:
    """Whether MLX has no compiled CPU kernels cached here yet (first compiled decode on this machine).

    MLX's CPU backend compiles the fused kernels of `mx.compile`d graphs with
    the system C++ compiler and keeps them under the temp directory.
    """
    import mlx.core as mx

    from mtplx_ext.compiled_step import mlx_kernel_cache_dir

    return mx.default_device() == mx.cpu and not any(mlx_kernel_cache_dir().glob("*.so"))


def cmd_generate(args: argparse.Namespace) -> int:
    texts = args.prompt or [DEFAULT_PROMPT]
    _check_prompt_text(texts)
    out = _Stdout()
    if not args.enforce_eager and mlx_kernel_cache_is_cold():
        print(
            "first compiled decode on this machine: MLX builds its fused CPU kernels with the C++ compiler "
            "(seconds, cached for later runs; --enforce-eager skips compiling)",
            file=sys.stderr,
        )
    rt = load_model(args.model, need_mtp=not args.no_mtp)
    tok = _tokenizer(rt, args.model)
    prompts = _encode(tok, texts)
    if len(prompts) == 1:
        header = texts[0]
    else:
        header = "".join(f"[{i}] prompt: {t!r}\n" for i, t in enumerate(texts))
    streamer = TextStreamer(tok, len(prompts), out=out, header=header)
    res = _decode(rt, prompts, args, on_commit=streamer, stop=_stop_ids(tok))
    streamer.finish()
    per_stream = res.generated_tokens / len(prompts)
    if args.no_mtp:
        mode = "plain decoding"
    else:
        per_depth = "/".join(f"{a:.2f}" for a in res.acceptance_per_depth)
        mode = (
            f"MTP depth {res.depth}, acceptance {res.acceptance_rate:.2f} (per depth {per_depth}), "
            f"mean accepted length {res.mean_accepted_length:.2f}"
        )
    print(
        f"-- {res.generated_tokens} tokens in {res.decode_s:.2f}s: {res.tokens_per_s:.1f} tokens/s, "
        f"{mode}, {res.forwards / max(per_stream, 1):.2f} forwards/token, "
        f"batch {len(prompts)}, {'compiled' if res.compiled else 'eager'} steps, BLAS {_blas.status().name}",
        file=sys.stderr,
    )
    return 0


# -- bench -------------------------------------------------------------------


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
    repair_cycles: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def engine_run(
    rt: Any,
    prompts: list[list[int]],
    n: int,
    mtp: bool,
    enforce_eager: bool = False,
    depth: int = 1,
    reject_mode: str = "repair",
) -> Run:
    """One greedy decode of `prompts` as one batch, timed (the benches' unit of work)."""
    r = mtplx_ext.generate_greedy_batched(
        rt, prompts, max_new_tokens=n, use_mtp_draft=mtp, enforce_eager=enforce_eager, depth=depth,
        reject_mode=reject_mode,
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
        repair_cycles=r.repair_cycles,
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
        repair_cycles=sum(r.repair_cycles for r in runs),
    )


def mlx_lm_model(folder: Path) -> Any:
    """The model as mlx-lm itself loads it (its own modules; MTP weights dropped)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(folder, strict=False)
    return model


def _mlx_lm_run(trunk: Any, prompts: list[list[int]], n: int) -> Run:
    """mlx-lm's own greedy generation of `trunk` (the peer baseline).

    Batch 1 uses `generate_step` (what `mlx_lm.generate` runs); larger batches
    `BatchGenerator` (what `mlx_lm.batch_generate` runs). Time counts from
    the first generated token, as the engine's decode time does.
    """
    import mlx.core as mx
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


def _parse_batches(text: str) -> list[int]:
    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch must be comma-separated positive ints, got {text!r}") from None
    if not batches or any(b < 1 for b in batches):
        raise argparse.ArgumentTypeError(f"--batch must be comma-separated positive ints, got {text!r}")
    return batches


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive int, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return parse


def versions() -> dict[str, str]:
    import importlib.metadata as md

    def ver(d: str) -> str:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "mtplx-ext": mtplx_ext.__version__,
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
    one MTP method per depth ("mtp" alone for [1]). `prompt_ids`: the
    prompts (default: the bench's own openings).
    """
    baseline = rt.trunk if baseline is None else baseline
    prompt_ids = _encode(tok, list(BENCH_PROMPTS)) if prompt_ids is None else prompt_ids
    depths = depths or [1]
    runners: dict[str, Any] = {}
    for d in depths:
        runners["mtp" if depths == [1] else f"mtp-k{d}"] = lambda p, d=d: engine_run(rt, p, n, True, enforce_eager, d)
    runners["plain"] = lambda p: engine_run(rt, p, n, False, enforce_eager)
    runners["mlx-lm"] = lambda p: _mlx_lm_run(baseline, p, n)
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
    return {
        "tokens": n,
        "repeats": repeats,
        "enforce_eager": bool(enforce_eager),
        "methods": methods,
        "prompts": len(prompt_ids),
        "rows": rows,
        "versions": versions(),
    }


def format_table(report: dict) -> str:
    """A Markdown table of a bench report."""
    engine = [r["compiled"] for r in report["rows"] if r.get("compiled") is not None]
    steps = "compiled (mx.compile)" if engine and all(engine) else "eager" if not any(engine) else "mixed"
    lines = [
        f"BLAS: {report['versions']['blas']}",
        f"engine decode steps: {steps}",
        f"{report['tokens']} new tokens per stream, median of {report['repeats']} repeats "
        "(x plain: median of the per-repeat ratios)",
        "",
        "| batch | method | tokens/s | x plain | acceptance | per depth | accepted length | forwards/token "
        "| same tokens as plain |",
        "|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in report["rows"]:
        acc = r["acceptance_rate"]
        fpt = r["forwards_per_token"]
        per = r.get("acceptance_per_depth") or []
        mal = r.get("mean_accepted_length")
        lines.append(
            f"| {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['ratio_to_plain']:.2f} | "
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
        return f"--plot skipped: matplotlib is not installed (pip install matplotlib); the table holds the numbers"
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


def _check_writable(flag: str, path: str) -> None:
    """Fails now, not after the whole run, when `path` cannot be written."""
    p = Path(path)
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise CLIError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None
    if not existed:
        p.unlink()  # a run that fails later leaves no empty file behind


def cmd_bench(args: argparse.Namespace) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            _check_writable(flag, path)
    out = _Stdout()
    rt = load_model(args.model, need_mtp=True)
    tok = _tokenizer(rt, args.model)
    print(f"BLAS: {_blas.describe()}", file=sys.stderr)
    baseline = mlx_lm_model(Path(args.model) if args.model else SHIPPED_MODEL)
    prompt_ids = heldout_prompts(tok, args.heldout, args.prompt_tokens, seed=args.seed) if args.heldout else None
    report = run_bench(
        rt, tok, args.batch, args.tokens, args.repeats, progress=not args.no_progress, baseline=baseline,
        enforce_eager=args.enforce_eager, depths=args.depth, prompt_ids=prompt_ids,
    )
    report["command"] = "mtplx-ext " + " ".join(args.argv)
    report["model"] = str(Path(args.model).resolve()) if args.model else "shipped:" + SHIPPED_MODEL.name
    out.write(format_table(report) + "\n")
    out.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    if args.plot:
        print(write_plot(report, args.plot), file=sys.stderr)
    return 0


# -- convert -----------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    from mtplx_ext import convert

    if args.mtp_from and (args.quantize or args.dtype):
        raise CLIError("--mtp-from matches the MLX folder's quantization and dtype; -q and --dtype do not apply")
    mtp_bits = ... if args.mtp_bits is None else (None if args.mtp_bits == "float" else int(args.mtp_bits))
    try:
        if args.mtp_from:
            mlx_folder, out = args.paths
            s = convert.add_mtp(args.mtp_from, mlx_folder, out, mtp_bits=mtp_bits, progress=not args.no_progress)
        else:
            hf_folder, out = args.paths
            s = convert.convert(
                hf_folder, out, quantize=args.quantize, q_bits=args.q_bits, q_group_size=args.q_group_size,
                mtp_bits=mtp_bits, dtype=args.dtype, progress=not args.no_progress,
            )
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise CLIError(str(e)) from e
    print(
        f"wrote {out}: {s['layout']} MTP head ({s['head_tensors']} tensors), "
        f"{s['bits_per_weight']:.2f} bits per weight, {s['bytes'] / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    return 0


# -- entry point -------------------------------------------------------------


def _sampler_flag(flag: str, field: str, kind: type = float):
    """A SamplerConfig field as a flag: the config's own check, the flag named."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            what = "an int" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}") from None
        try:
            return sampling.check_field(field, v)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e).replace(f"SamplerConfig.{field}", flag, 1)) from None

    return parse


def _depth(text: str) -> int:
    try:
        d = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--depth must be an integer in 1..8, got {text!r}") from None
    if not 1 <= d <= 8:
        raise argparse.ArgumentTypeError(f"--depth must be in 1..8, got {d}")
    return d


def _depths(text: str) -> list[int]:
    return sorted({_depth(t) for t in text.split(",") if t.strip()}) or [1]


def heldout_prompts(tok: Any, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens cut at random offsets from the held-out stdlib files.

    The shipped model never saw these files (`mtplx_ext.train`'s split), so
    acceptance on them is what a user's new text gets, not the training set's.
    """
    from mtplx_ext import train  # noqa: PLC0415

    root = train.stdlib_root()
    _, held = train.split_files(train.stdlib_files(root), root)
    rng = np.random.default_rng(seed)
    texts = [train.read_text(p) for p in held]
    out = []
    for _ in range(100 * n):
        ids = tok.encode(texts[int(rng.integers(len(texts)))]).ids
        if len(ids) > 2 * length:
            s = int(rng.integers(0, len(ids) - length))
            out.append(ids[s : s + length])
        if len(out) == n:
            return out
    raise CLIError(f"--heldout: could not cut {n} prompts of {length} tokens from the held-out files")


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed must be an int, got {text!r}") from None
    try:
        return as_int("--seed", v, 0, SEED_LIMIT)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtplx-ext", description="Batched MTP speculative decoding on MLX.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode prompts as one batch, streaming text")
    g.add_argument("prompt", nargs="*", help=f"prompt texts (default: {DEFAULT_PROMPT!r})")
    g.add_argument("--model", help="model folder (default: the shipped model)")
    g.add_argument("--max-tokens", type=_positive("--max-tokens"), default=128)
    g.add_argument("--temperature", type=_sampler_flag("--temperature", "temperature"), default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=_sampler_flag("--top-p", "top_p"), default=1.0)
    g.add_argument("--top-k", type=_sampler_flag("--top-k", "top_k", int), default=0, help="0 = off")
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--no-mtp", action="store_true", help="plain autoregressive decoding")
    g.add_argument("--depth", type=_depth, default=1, help="MTP drafts per cycle, 1..8")
    g.add_argument("--enforce-eager", action="store_true", help="build every decode step in Python (no mx.compile)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="MTP vs plain decoding vs mlx-lm, tokens/s")
    b.add_argument("--model", help="model folder (default: the shipped model)")
    b.add_argument(
        "--batch",
        type=_parse_batches,
        default=[1, 4, 8],
        help="batch sizes, e.g. 1,4,8 (each decodes all 8 bench prompts, b at a time)",
    )
    b.add_argument("--tokens", type=_positive("--tokens"), default=128, help="new tokens per stream")
    b.add_argument("--depth", type=_depths, default=[1], help="MTP depths to sweep, e.g. 1,2,3,4,5")
    b.add_argument(
        "--heldout", type=_positive("--heldout"), default=0,
        help="N prompts cut at random from held-out Python stdlib files (not trained on) instead of the bench's own",
    )
    b.add_argument("--prompt-tokens", type=_positive("--prompt-tokens"), default=48, help="tokens per held-out prompt")
    b.add_argument("--seed", type=_seed, default=0, help="where the held-out prompts are cut")
    b.add_argument("--repeats", type=_positive("--repeats"), default=3)
    b.add_argument("--json", help="write the full report here")
    b.add_argument("--plot", help="write a bar chart PNG here (needs matplotlib)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--enforce-eager", action="store_true", help="the engine builds every step in Python (no mx.compile)")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser(
        "convert",
        help="Hugging Face checkpoint -> MLX folder that keeps the MTP head",
        usage="mtplx-ext convert HF_FOLDER OUT [options]  |  mtplx-ext convert --mtp-from HF_FOLDER MLX_FOLDER OUT",
    )
    c.add_argument("paths", nargs=2, metavar="FOLDER", help="HF_FOLDER OUT, or with --mtp-from: MLX_FOLDER OUT")
    c.add_argument("--mtp-from", metavar="HF_FOLDER", help="add this checkpoint's MTP head to the MLX folder")
    c.add_argument("-q", "--quantize", action="store_true", help="quantize (mlx-lm's affine quantization)")
    c.add_argument("--q-bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=4)
    c.add_argument("--q-group-size", type=int, choices=(32, 64, 128), default=64)
    c.add_argument("--mtp-bits", choices=("2", "3", "4", "5", "6", "8", "float"),
                   help="the head's bits (default: the trunk's; float: keep the head unquantized)")
    c.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="float weights' dtype (default: the config's torch_dtype, else as stored)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    s = sub.add_parser("serve", help="OpenAI-compatible server with continuous MTP batching")
    s.add_argument("--model", help="model folder (default: the shipped model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--max-batch", type=_positive("--max-batch"), default=8, help="most streams decoding at once")
    s.add_argument("--depth", type=_depth, default=1, help="MTP drafts per cycle, 1..8")
    s.add_argument("--no-mtp", action="store_true", help="plain autoregressive decoding (the baseline)")
    s.add_argument("--max-kv-slots", type=_positive("--max-kv-slots"), help="most KV slots of the running batch")
    s.add_argument("--prefill-chunk", type=_positive("--prefill-chunk"), default=256)
    s.add_argument("--api-key", help="require Authorization: Bearer KEY")
    s.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    """`mtplx-ext serve`: loads the model and serves it until SIGINT / SIGTERM."""
    from mtplx_ext.serve import serve  # noqa: PLC0415

    if not 0 <= args.port < 65536:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    rt = load_model(args.model, need_mtp=not args.no_mtp)
    folder = Path(args.model) if args.model else SHIPPED_MODEL
    try:
        serve(rt, folder, host=args.host, port=args.port, max_batch=args.max_batch, depth=args.depth,
              use_mtp=not args.no_mtp, api_key=args.api_key, max_kv_slots=args.max_kv_slots,
              prefill_chunk=args.prefill_chunk)
    except ValueError as e:
        raise CLIError(str(e)) from e
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs `mtplx-ext`; returns the exit status.

    0 on success; 2 for a user error (one line on stderr: bad flags, model
    folders, prompts, an unwritable output); 130 on Ctrl-C; 141 (as for a
    process ended by SIGPIPE) without a message when the reader of stdout
    goes away, as in `mtplx-ext generate ... | head`.
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except BrokenPipeError:
        _drop_stdout()
        return 141
    except CLIError as e:
        if isinstance(e, StdoutError):
            _drop_stdout()
        print(f"mtplx-ext: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmtplx-ext: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
