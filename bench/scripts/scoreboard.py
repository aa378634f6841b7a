"""Regenerates the scoreboard section of bench/RESULTS.md from the result files that record their provenance.

    python bench/scripts/scoreboard.py            # rewrite the section in place
    python bench/scripts/scoreboard.py --check    # exit 1 when the section is out of date

Reads every `bench/results/*.json` (not `bench/results/archive/`) that has a
"provenance" key (`mtplx_ext.benchmark.provenance`, written by every bench
script and `mtplx-ext bench --json`). A result is on the scoreboard unless

* a newer result (by its UTC time) of the same script, arguments, model
  weights and CPU supersedes it, or
* it measured the shipped model with other weights than the ones in this
  checkout (an earlier head, say).

Left-off results are listed under the tables with the reason. Only the text
between the two marker lines is rewritten: the hand-written sections of
RESULTS.md (latest figures recorded before provenance, the history) stay as
they are. The output depends on the files alone (no git, no clock), so
`--check` gives the same answer everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
SHIPPED = ROOT / "python" / "mtplx_ext" / "assets" / "tiny-qwen3-mtp"
SHIPPED_REL = "mtplx_ext/assets/tiny-qwen3-mtp"  # a checkout's or an installed package's
BEGIN = "<!-- scoreboard:begin (bench/scripts/scoreboard.py writes this section from bench/results/*.json; edit the script, not the text) -->"
END = "<!-- scoreboard:end -->"
#: Arguments that name where a result goes, not what it measured.
OUTPUT_FLAGS = ("--json", "--plot", "--out")


def script_name(prov: dict) -> str:
    """The script (or `mtplx-ext <verb>`) a result came from, from its command line."""
    cmd = prov.get("command") or ["?"]
    first = Path(str(cmd[0])).name
    if first in ("mtplx-ext", "__main__.py", "cli") and len(cmd) > 1:
        return f"mtplx-ext {cmd[1]}"
    return first


def measured_args(prov: dict) -> tuple[str, ...]:
    """The command's arguments without the output paths (two runs that differ only there measured the same)."""
    args, out, skip = [str(a) for a in (prov.get("command") or [])[1:]], [], False
    for a in args:
        if skip:
            skip = False
        elif a in OUTPUT_FLAGS:
            skip = True
        elif not a.startswith(tuple(f"{f}=" for f in OUTPUT_FLAGS)):
            out.append(a)
    return tuple(out)


def _model_key(prov: dict) -> tuple[str, ...]:
    return tuple(str(m.get("sha256") or m.get("error")) for m in prov.get("models", []))


def _fmt(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


# -- headline figures per script ---------------------------------------------------


def _long_context(d: dict) -> list[str]:
    out = []
    for r in d.get("rows", []):
        depths = sorted((k for k in r if k.startswith("depth") and k[5:].isdigit()), key=lambda k: int(k[5:]))
        kv = "f32" if r.get("kv_bits") is None else f"{r['kv_bits']}-bit"
        best = max((r[k] for k in depths), default=r["plain"])
        cells = ", ".join(f"K={k[5:]} {_fmt(r[k])}" for k in depths)
        out.append(f"ctx {r['context']} b{r['batch']} {kv}: plain {_fmt(r['plain'])}, {cells} tok/s "
                   f"({best / r['plain']:.2f}x)")
    return out


def _llama_cpp_peer(d: dict) -> list[str]:
    out = []
    for r in d.get("rows", []):
        for b in ("b1", "b8"):
            if f"{b}_plain_tps" not in r:
                continue
            k = r.get(f"{b}_best_mtp_depth")
            best = r.get(f"{b}_mtp{k}_tps", 0.0)
            out.append(f"{r['format']} {b}: llama.cpp {_fmt(r[f'{b}_llama_tps'])}, plain {_fmt(r[f'{b}_plain_tps'])}, "
                       f"MTP K={k} {_fmt(best)} tok/s")
    return out


def _serve_load(d: dict) -> list[str]:
    mtp, plain = d.get("mtp", []), {r["concurrency"]: r for r in d.get("plain", [])}
    best = {r["concurrency"]: r for r in d.get("vs_best", [])}
    return [f"c{r['concurrency']}: MTP {_fmt(r['tokens_per_s'])} / off {_fmt(plain[r['concurrency']]['tokens_per_s'])} tok/s "
            f"({r['tokens_per_s'] / plain[r['concurrency']]['tokens_per_s']:.2f}x), failed {r['failed']}"
            + (f"; vs best of off and fixed depths {_vs_best(best[r['concurrency']])}" if r["concurrency"] in best else "")
            for r in mtp if r["concurrency"] in plain]


def _vs_best(b: dict) -> str:
    """The default against the best other server: its ratio, and the rounds' bootstrap interval where recorded."""
    if "low" not in b:
        return f"{b['ratio']:.2f}x"
    return f"{b['ratio']:.2f}x ({b['best']}; 95% interval {b['low']:.2f}-{b['high']:.2f}x)"


def _depth_sweep(d: dict) -> list[str]:
    out = []
    for b, v in sorted(d.get("batches", {}).items(), key=lambda kv: int(kv[0])):
        best = max(v.get("depths", []), key=lambda r: r["x_plain"], default=None)
        tail = f", best K={best['depth']} {_fmt(best['tokens_per_s'])} ({best['x_plain']:.2f}x)" if best else ""
        out.append(f"b{b}: plain {_fmt(v['plain']['tokens_per_s'])} tok/s{tail}")
    return out


def _bench(d: dict) -> list[str]:
    out = []
    for b in sorted({r["batch"] for r in d.get("rows", [])}):
        rows = [r for r in d["rows"] if r["batch"] == b]
        plain = next((r for r in rows if r["method"] == "plain"), None)
        best = max((r for r in rows if r["method"].startswith("mtp")), key=lambda r: r["tokens_per_s"], default=None)
        if plain and best:  # the run's own paired ratio where it has one
            ratio = best.get("ratio_to_plain") or best["tokens_per_s"] / plain["tokens_per_s"]
            out.append(f"b{b}: plain {_fmt(plain['tokens_per_s'])}, {best['method']} {_fmt(best['tokens_per_s'])} tok/s "
                       f"({ratio:.2f}x)")
    return out


def _agent_turns(d: dict) -> list[str]:
    last, size = d["rows"][-1], d["cache_bytes"]
    return [f"turn {last['turn']} TTFT {last['speedup']:.1f}x with the prefix cache, same replies {d['same_replies']}",
            f"cache {size['ratio']:.2f}x the last prompt's KV", f"after a restart {d['restart_speedup']:.1f}x"]


def _grammar_choice(d: dict) -> list[str]:
    out = []
    for name, e in d.get("engines", {}).items():
        if "missing" in e:
            continue
        out.append(f"{name}: mask/token median json_schema {e['json_schema']['median_ms'] * 1e3:.0f} us, tool call "
                   f"{e['tool_call']['median_ms'] * 1e3:.0f} us; installs {_fmt(e['install']['added_to_serve_mb'])} MB")
    return out


def _fixed_batches(d: dict) -> list[str]:
    return [f"{Path(r['model']).name} b{r['batch']} {'K=' + str(r['depth']) if r['mtp'] else 'plain'}: engine "
            f"{_fmt(r['engine_tps'])} / reference {_fmt(r['reference_tps'])} tok/s ({r['ratio']:.2f}x)"
            f"{'' if r['same_tokens'] else ', TOKENS DIFFER'}" for r in d.get("rows", [])]


HEADLINES: dict[str, Callable[[dict], list[str]]] = {
    "long_context.py": _long_context, "llama_cpp_peer.py": _llama_cpp_peer, "serve_load.py": _serve_load,
    "depth_sweep.py": _depth_sweep, "mtplx-ext bench": _bench, "grammar_choice.py": _grammar_choice,
    "agent_turns.py": _agent_turns, "fixed_batches.py": _fixed_batches,
}


def headline(script: str, data: dict) -> list[str]:
    """The figures a result's scoreboard row shows (empty where the script has no summary here)."""
    try:
        return HEADLINES[script](data) if script in HEADLINES else []
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return ["(figures not in the expected shape; see the file)"]


# -- selection and rendering ---------------------------------------------------------------


def load_results(folder: Path) -> tuple[list[tuple[str, dict]], int]:
    """(name, data) of the files with provenance, sorted by name; and how many files had none."""
    with_prov, without = [], 0
    for f in sorted(folder.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            without += 1
            continue
        if isinstance(data, dict) and isinstance(data.get("provenance"), dict):
            with_prov.append((f.name, data))
        else:
            without += 1
    return with_prov, without


def shipped_weights(folder: Path = SHIPPED) -> dict[str, Any] | None:
    """This checkout's shipped model hash, as `provenance` records it (None when it cannot be read)."""
    try:
        from mtplx_ext.benchmark.provenance import weights_hash
    except ImportError:
        return None
    try:
        return weights_hash(folder)
    except OSError:
        return None


def select(results: list[tuple[str, dict]], shipped: dict | None) -> tuple[list[tuple[str, dict]], list[str]]:
    """The results on the scoreboard, and a "name: reason" line for each one left off."""
    kept, off = [], []
    for name, data in results:
        p = data["provenance"]
        for m in p.get("models", []):
            if shipped and str(m.get("path", "")).endswith(SHIPPED_REL) and (
                    m.get("sha256") != shipped["sha256"] or m.get("head_sha256") != shipped["head_sha256"]):
                off.append(f"`{name}`: measured the shipped model with other weights than this checkout's")
                break
        else:
            kept.append((name, data))
    newest: dict[tuple, tuple[str, dict]] = {}
    for name, data in kept:
        p = data["provenance"]
        key = (script_name(p), measured_args(p), _model_key(p), p.get("cpu"), p.get("cores"))
        if key in newest:
            other = newest[key]
            old, new = sorted([other, (name, data)], key=lambda nd: (nd[1]["provenance"].get("utc") or "", nd[0]))
            off.append(f"`{old[0]}`: superseded by `{new[0]}` (same script, arguments, weights and CPU)")
            newest[key] = new
        else:
            newest[key] = (name, data)
    on = sorted(newest.values(), key=lambda nd: (script_name(nd[1]["provenance"]), nd[0]))
    return on, sorted(off)


def _row(name: str, data: dict) -> str:
    p = data["provenance"]
    commit = (p.get("commit") or "installed package")[:10] + (" (dirty)" if p.get("dirty") else "")
    cpu = f"{p.get('cpu') or '?'} ({p.get('cores')} cores)"
    versions = p.get("versions", {})
    libs = f"mlx {versions.get('mlx', '?')}, mlx-lm {versions.get('mlx-lm', '?')}"
    models = ", ".join(f"{Path(str(m.get('path'))).name} `{str(m.get('sha256', 'unreadable'))[:12]}`"
                       for m in p.get("models", [])) or "-"
    figures = "; ".join(headline(script_name(p), data)) or "see the file"
    when = str(p.get("utc", "?"))[:10]
    return f"| [`{name}`](results/{name}) | {when} | `{commit}` | {cpu}; {libs} | {models} | {figures} |"


def render(results: list[tuple[str, dict]], without: int, shipped: dict | None) -> str:
    """The scoreboard section, markers included."""
    lines = [BEGIN, "## Scoreboard", ""]
    on, off = select(results, shipped)
    if not results:
        lines += [
            f"No result file in `bench/results/` records its provenance yet ({without} files predate it). Every bench",
            "script now records it (`mtplx_ext.benchmark.provenance`: commit, CPU, cores, library versions, model",
            "weights hash, command); until runs that record it are added here, the current figures are the ones under",
            "[Latest figures (recorded before provenance)](#latest-figures-recorded-before-provenance), copied by hand",
            "with the commit that recorded them.",
        ]
    else:
        lines += [
            f"{len(on)} of the {len(results)} result files with provenance ({without} more predate it). A result",
            "leaves the scoreboard when a newer run of the same script, arguments, weights and CPU supersedes it, or",
            "when it measured the shipped model with other weights than this checkout's. Columns: the file, the day",
            "it was measured (UTC), the commit (\"dirty\": tracked files differed from it), the machine and libraries,",
            "the models (weights hash, `weights_hash`), and its headline figures.",
        ]
        for script in sorted({script_name(d["provenance"]) for _, d in on}):
            lines += ["", f"### {script}", "", "| result | measured | commit | machine | models | figures |",
                      "|---|---|---|---|---|---|"]
            lines += [_row(n, d) for n, d in on if script_name(d["provenance"]) == script]
        if off:
            lines += ["", "Left off the scoreboard:", ""] + [f"- {o}" for o in off]
    lines += ["", END]
    return "\n".join(lines)


def replace_section(text: str, section: str) -> str:
    """`text` with the part between the markers (inclusive) replaced by `section`.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"RESULTS.md lacks the scoreboard markers ({BEGIN!r} ... {END!r})")
    return text[:start] + section + text[end + len(END):]


def main(argv: list[str] | None = None, results_dir: Path = RESULTS_DIR, results_md: Path = RESULTS_MD,
         shipped_dir: Path = SHIPPED) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when RESULTS.md's scoreboard is out of date")
    args = ap.parse_args(argv)
    results, without = load_results(results_dir)
    section = render(results, without, shipped_weights(shipped_dir))
    old = results_md.read_text()
    new = replace_section(old, section)
    if args.check:
        if new != old:
            print(f"{results_md} is out of date: run python bench/scripts/scoreboard.py", file=sys.stderr)
            return 1
        return 0
    results_md.write_text(new)
    print(f"wrote the scoreboard of {results_md} ({len(results)} result files with provenance)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
