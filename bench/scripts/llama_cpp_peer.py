"""llama.cpp vs mtplx_ext on the same weights, side by side in one run.

    python bench/scripts/llama_cpp_peer.py --model FLOAT_DIR [--q4 DIR] [--q8 DIR]
        [--work DIR] [--repeats 3] [--depths 1,2,3,4] [--json out.json]

Contract:
- llama.cpp is the tree vendored in the llama-cpp-python 0.3.36 sdist (pip download from the configured
  index), built once (CMake Release, GGML_NATIVE=ON: llama-bench, llama-batched-bench, llama-quantize) under
  --work and reused later.  If it cannot be fetched, built or run, one line says why, --json gets
  {"skipped": reason, ...} and the exit status is 0.
- --model is a float qwen3 folder.  Only its trunk becomes GGUF F32 (mtp* files and mtp.* tensors left
  out; the vendored converter runs unmodified through a wrapper that names an unknown BPE pre-tokenizer
  "gpt-2", the byte-level regex these tokenizers use), then llama-quantize makes Q8_0 and Q4_0.  --q8 /
  --q4 are `mtplx-ext convert -q --q-bits 8|4 --q-group-size 64` folders of it, made when not given.
- Each round runs, per format, llama-bench (batch 1: -p 0 -n TOKENS -r 1), llama-batched-bench (-npp 16
  -ntg TOKENS -npl 1,8: S_TG, aggregate decode) and ours (greedy, plain and MTP at each of --depths;
  batch 1: the first prompt, batch 8: all eight), interleaved; an untimed first round warms ours up.
  Figures are medians over --repeats.  Ours is committed tokens / wall time of generate_greedy_batched
  (a ~10-token prefill included; the package's decode-only figure is kept too); llama.cpp's are
  generation only.  llama.cpp commands time out after 600 s; builds and conversions run at nice 19.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import mtplx_ext  # before mlx, so MLX gets the fast BLAS
from mtplx_ext.benchmark.provenance import provenance

VERSION = "0.3.36"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
TIMEOUT = 600
LONG_TIMEOUT = 4 * 3600
FORMATS = ("F32", "Q8_0", "Q4_0")
PROMPTS = (  # held-out Python openings
    "def parse_args(argv):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
    "def read_csv_rows(path, delimiter=','):\n", "import os\n\ndef walk_python_files(root):\n",
    "def merge_intervals(intervals):\n", "class Stack:\n    def push(self, item):\n",
    "def retry(times, exceptions=(Exception,)):\n", 'def flatten(nested):\n    """Yield the leaves."""\n',
)
#: Runs the vendored converter as it is, but an unknown BPE pre-tokenizer hash
#: maps to "gpt-2" and mtp.* tensors inside trunk shards are dropped.
CONVERT_WRAPPER = '''
import sys
from pathlib import Path
root = Path(sys.argv.pop(1))
sys.path.insert(0, str(root))  # gguf-py comes from PYTHONPATH
import convert_hf_to_gguf as c
from conversion.base import ModelBase, TextModel
def get_vocab_base_pre(self, tokenizer, pre=TextModel.get_vocab_base_pre):
    try:
        return pre(self, tokenizer)
    except NotImplementedError:  # unknown hash
        return "gpt-2"
def index_tensors(self, *a, index=ModelBase.index_tensors, **k):
    return {n: g for n, g in index(self, *a, **k).items() if not n.startswith(("mtp.", "model.mtp."))}
TextModel.get_vocab_base_pre, ModelBase.index_tensors = get_vocab_base_pre, index_tensors
sys.argv[0] = str(root / "convert_hf_to_gguf.py")
c.main()
'''


class Skip(Exception):
    """The peer cannot be set up or run here; the message says why."""


class Killed(Skip):
    """A run killed by a signal on its last try."""


# llama.cpp runs killed by a signal and rerun (its AMX kernels, compiled in by GGML_NATIVE on a CPU with
# AMX, die now and then of SIGILL on a tile instruction: a known upstream bug), recorded in the JSON.
CRASHES: list[str] = []


def run(cmd: list[str], timeout: float = TIMEOUT, nice: int | None = None, retries: int = 0, **kw: Any) -> str:
    """cmd's stdout; Skip on a missing program, a failure or a timeout (a run killed by a signal is
    rerun up to `retries` times)."""
    if nice is not None and shutil.which("nice"):
        cmd = ["nice", "-n", str(nice), *cmd]
    for _ in range(retries + 1):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Skip(f"{Path(cmd[0]).name}: {e}") from e
        if p.returncode >= 0:
            break
        CRASHES.append(f"{Path(cmd[0]).name} {Path(cmd[2]).name}: signal {-p.returncode}")
    if p.returncode:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise (Killed if p.returncode < 0 else Skip)(f"{' '.join(cmd[:3])} ... exited {p.returncode}: {' | '.join(tail)}")
    return p.stdout


def build_llama(work: Path, jobs: int) -> tuple[Path, Path]:
    """The vendored llama.cpp source folder and its bin folder, fetched and built if needed."""
    src = work / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    bld, bins = work / "llama-build", work / "llama-build" / "bin"
    if all((bins / t).is_file() for t in TOOLS) and (src / "convert_hf_to_gguf.py").is_file():
        return src, bins
    if missing := [p for p in ("cmake", "c++", "cc") if not shutil.which(p)]:
        raise Skip(f"no {', '.join(missing)} on PATH")
    if not (src / "CMakeLists.txt").is_file():
        sdist = work / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            run([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
                 "--no-build-isolation", f"llama-cpp-python=={VERSION}", "-d", str(work)], timeout=1800)
        if not sdist.is_file():
            raise Skip(f"pip download left no {sdist.name} in {work}")
        with tarfile.open(sdist) as tf:
            tf.extractall(work, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        if not (src / "CMakeLists.txt").is_file():
            raise Skip("the sdist has no vendor/llama.cpp tree")
    off = ("LLAMA_CURL", "LLAMA_OPENSSL", "LLAMA_BUILD_SERVER", "LLAMA_BUILD_TESTS", "LLAMA_BUILD_EXAMPLES",
           "LLAMA_BUILD_APP", "LLAMA_BUILD_UI", "LLAMA_LLGUIDANCE", "BUILD_SHARED_LIBS")
    run(["cmake", "-S", str(src), "-B", str(bld), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         *[f"-D{o}=OFF" for o in off]], timeout=LONG_TIMEOUT, nice=19)
    run(["cmake", "--build", str(bld), "--config", "Release", "-j", str(jobs), "--target", *TOOLS],
        timeout=LONG_TIMEOUT, nice=19)
    if missing := [t for t in TOOLS if not (bins / t).is_file()]:
        raise Skip(f"the build made no {', '.join(missing)}")
    return src, bins


def folder_key(folder: Path) -> str:
    """The cache key: the folder's name and a hash of its path and its files' sizes and times."""
    h = hashlib.sha1(str(folder.resolve()).encode())
    for f in sorted(folder.iterdir()):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return f"{folder.name}-{h.hexdigest()[:10]}"


def trunk_folder(model: Path, out: Path) -> Path:
    """`model` without its MTP head: links to its files but mtp*, an index without them, a config with
    `architectures` (mlx-style folders may lack it; the converter picks its model class by it)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = config.get("architectures") or ["Qwen3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in model.iterdir():
        if f.name not in ("config.json", "model.safetensors.index.json") and not f.name.startswith("mtp"):
            (out / f.name).symlink_to(f.resolve())
    index = model / "model.safetensors.index.json"
    if index.is_file():  # names in linked shards stay (the converter checks the index against them)
        d = json.loads(index.read_text())
        d["weight_map"] = {k: v for k, v in d["weight_map"].items() if (out / v).exists()}
        (out / index.name).write_text(json.dumps(d, indent=2))
    return out


def make_ggufs(model: Path, src: Path, bins: Path, work: Path, threads: int) -> dict[str, Path]:
    """GGUF F32 of the model's trunk and its Q8_0 / Q4_0 quantizations (cached under work)."""
    out = work / "gguf" / folder_key(model)
    paths = {f: out / f"{f.lower()}.gguf" for f in FORMATS}
    if all(p.is_file() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    trunk = trunk_folder(model, work / "trunk" / out.name)
    wrapper = work / "convert_wrapper.py"
    wrapper.write_text(CONVERT_WRAPPER)
    pythonpath = os.pathsep.join(filter(None, [str(src / "gguf-py"), os.environ.get("PYTHONPATH")]))
    tmp = out / "partial.gguf"
    run([sys.executable, str(wrapper), str(src), str(trunk), "--outtype", "f32", "--outfile", str(tmp)],
        timeout=LONG_TIMEOUT, nice=19, env={**os.environ, "PYTHONPATH": pythonpath})
    tmp.rename(paths["F32"])
    for f in ("Q8_0", "Q4_0"):
        run([str(bins / "llama-quantize"), str(paths["F32"]), str(tmp), f, str(threads)], nice=19)
        tmp.rename(paths[f])
    return paths


def llama_cpp(bins: Path, gguf: Path, threads: int, tokens: int) -> tuple[dict[str, Any], dict[int, float]]:
    """llama-bench's JSON row (batch 1, one repetition) and llama-batched-bench's S_TG at 1 and 8 sequences."""
    lb = json.loads(run([str(bins / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0",
                         "-n", str(tokens), "-r", "1", "-o", "json"], retries=3))[0]
    bb_cmd = [str(bins / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-npp", "16",
              "-ntg", str(tokens), "-npl", "1,8", "-c", str(max(2048, 8 * (16 + tokens))), "--output-format", "jsonl"]
    try:
        out = run(bb_cmd, retries=2)
    except Killed:
        # Still killed: without the extra buffer types (its AMX kernels among them), recorded.
        CRASHES.append(f"llama-batched-bench {gguf.name}: rerun with --no-repack")
        out = run([*bb_cmd, "--no-repack"], retries=2)
    # Its JSON rows, wherever they sit in the output (a log line can share a line with one).
    rows = (json.loads(m) for m in re.findall(r"\{[^{}]*\}", out))
    bb = {r["pl"]: r["speed_tg"] for r in rows if "pl" in r and "speed_tg" in r}
    if not {1, 8} <= set(bb):
        raise Skip(f"llama-batched-bench printed no rows for 1 and 8 sequences: {out[-300:]!r}")
    return lb, bb


def ours(rt: Any, prompts: list[list[int]], tokens: int, depth: int) -> dict[str, float]:
    """One greedy decode (depth 0: plain): tokens/s over wall time and over decode, acceptance."""
    t = time.perf_counter()
    r = mtplx_ext.generate_greedy_batched(rt, prompts, max_new_tokens=tokens, use_mtp_draft=depth > 0,
                                          depth=max(depth, 1))
    wall = time.perf_counter() - t
    return {"tps": sum(len(s.tokens) for s in r.streams) / wall, "decode_only_tps": r.tokens_per_s,
            "acceptance": r.accepted / r.drafted if r.drafted else 0.0}


def versions(src: Path | None) -> dict[str, Any]:
    from importlib.metadata import version

    def git(cwd: Path | None, *args: str) -> str | None:
        try:
            p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if cwd and p.returncode == 0 else None

    repo = Path(__file__).resolve().parents[2]
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), platform.processor())
    return {"mlx": version("mlx"), "mlx-lm": version("mlx-lm"), "mtplx_ext": git(repo, "rev-parse", "HEAD"),
            "mtplx_ext_dirty": bool(git(repo, "status", "--porcelain", "--untracked-files=no")),
            "llama-cpp-python": VERSION, "llama.cpp": git(src, "rev-parse", "--short", "HEAD") if src else None,
            "cpu": cpu, "cpus": os.cpu_count(), "blas": repr(mtplx_ext.BLAS), "python": platform.python_version(),
            "threads_env": {k: v for k, v in os.environ.items() if k.endswith("_THREADS")}}


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def measure(args: argparse.Namespace, bins: Path, ggufs: dict[str, Path], depths: list[int]) -> list[dict[str, Any]]:
    """The interleaved rounds; per format, a row of medians and repeats."""
    folders: dict[str, Path] = {"F32": args.model}
    for f, given, bits in (("Q8_0", args.q8, 8), ("Q4_0", args.q4, 4)):
        folders[f] = given or args.work / "mlx" / f"{folder_key(args.model)}-q{bits}"
        if not given and not folders[f].is_dir():
            tmp = folders[f].with_name(folders[f].name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            run(["mtplx-ext", "convert", str(args.model), str(tmp), "-q", "--q-bits", str(bits),
                 "--q-group-size", "64", "--no-progress"], timeout=LONG_TIMEOUT, nice=19)
            tmp.rename(folders[f])
    rts = {f: mtplx_ext.load(folders[f]) for f in FORMATS}
    prompts = [rts["F32"].tokenizer.encode(p).ids for p in PROMPTS]
    groups, methods = {1: prompts[:1], 8: prompts}, [0, *depths]
    peer: dict[tuple[str, str], list[float]] = {(f, k): [] for f in FORMATS for k in ("b1", "b1_batched", "b8")}
    us: dict[tuple[str, int, int], list[dict[str, float]]] = {(f, b, d): [] for f in FORMATS for b in groups
                                                              for d in methods}
    meta: dict[str, Any] = {}
    for rep in range(args.repeats + 1):
        for f in FORMATS:
            if rep:
                lb, bb = llama_cpp(bins, ggufs[f], args.threads, args.tokens)
                peer[f, "b1"].append(lb["avg_ts"])
                peer[f, "b1_batched"].append(bb[1])
                peer[f, "b8"].append(bb[8])
                meta[f] = {k: v for k, v in lb.items() if not k.startswith(("avg_", "stddev_", "samples_"))}
            for b, g in groups.items():
                for d in methods:
                    r = ours(rts[f], g, args.tokens, d)
                    if rep:
                        us[f, b, d].append(r)
            print(f"round {rep}/{args.repeats} ({'timed' if rep else 'warm-up'}): {f} done", flush=True)
    rows = []
    for f in FORMATS:
        row: dict[str, Any] = {"format": f, "gguf": str(ggufs[f]), "gguf_bytes": ggufs[f].stat().st_size,
                               "mlx_folder": str(folders[f]), "llama_cpp": meta.get(f),
                               "b1_llama_batched_bench_tps": med(peer[f, "b1_batched"])}
        for b in groups:
            row[f"b{b}_llama_tps"] = ref = med(peer[f, f"b{b}"])
            row[f"b{b}_llama_tps_repeats"] = peer[f, f"b{b}"]
            for d in methods:
                rs, name = us[f, b, d], f"b{b}_" + (f"mtp{d}" if d else "plain")
                row[f"{name}_tps"] = tps = med([r["tps"] for r in rs])
                row[f"{name}_tps_repeats"] = [r["tps"] for r in rs]
                row[f"{name}_decode_only_tps"] = med([r["decode_only_tps"] for r in rs])
                if d:
                    row[f"{name}_acceptance"] = med([r["acceptance"] for r in rs])
                row[f"{name}_ratio"] = tps / ref if tps and ref else None
            best = max(depths, key=lambda d: row[f"b{b}_mtp{d}_tps"] or 0.0, default=None)
            row[f"b{b}_best_mtp_depth"] = best
            row[f"b{b}_best_mtp_ratio"] = row[f"b{b}_mtp{best}_ratio"] if best else None
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], depths: list[int], repeats: int) -> None:
    num = lambda x, suffix="": f"{x:.2f}{suffix}" if x is not None else "-"  # noqa: E731
    for b, tool in ((1, "llama-bench"), (8, "llama-batched-bench S_TG")):
        print(f"\nbatch {b}: decode tokens/s, medians of {repeats} (llama.cpp: {tool}; "
              "ours: committed tokens / wall time)")
        print("| format | llama.cpp | ours plain | " + " | ".join(f"MTP d{d}" for d in depths)
              + " | plain / llama.cpp | best MTP / llama.cpp |")
        print("|---" * (5 + len(depths)) + "|")
        for r in rows:
            cells = [r["format"], num(r[f"b{b}_llama_tps"]), num(r[f"b{b}_plain_tps"]),
                     *[num(r[f"b{b}_mtp{d}_tps"]) for d in depths], num(r[f"b{b}_plain_ratio"], "x"),
                     num(r[f"b{b}_best_mtp_ratio"], f"x (d{r[f'b{b}_best_mtp_depth']})")]
            print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="float qwen3 folder")
    ap.add_argument("--q4", type=Path, help="its `mtplx-ext convert -q --q-bits 4 --q-group-size 64` folder")
    ap.add_argument("--q8", type=Path, help="its 8-bit folder, likewise")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mtplx-llama-cpp-peer")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
    ap.add_argument("--jobs", type=int, default=2, help="build jobs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    args.work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": [sys.executable, *sys.argv], "tokens": args.tokens, "threads": args.threads,
                              "repeats": args.repeats, "depths": depths, "loadavg_start": os.getloadavg()}
    src: Path | None = None
    try:
        src, bins = build_llama(args.work, args.jobs)
        ggufs = make_ggufs(args.model, src, bins, args.work, args.threads)
        report["rows"] = rows = measure(args, bins, ggufs, depths)
        print_table(rows, depths, args.repeats)
    except Skip as e:
        print(f"llama.cpp peer benchmark skipped: {e}")
        report["skipped"] = str(e)
    report["loadavg_end"] = os.getloadavg()
    report["llama_cpp_crashes_rerun"] = CRASHES
    report["versions"] = versions(src)
    report["versions"]["llama.cpp_build"] = next(
        (r["llama_cpp"]["build_commit"] for r in report.get("rows", []) if r["llama_cpp"]), None)
    if args.json:
        report["provenance"] = provenance([m for m in (args.model, args.q4, args.q8) if m is not None])
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
