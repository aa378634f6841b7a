"""bench/scripts/scoreboard.py: RESULTS.md's scoreboard is current, built from provenance, and only that section changes."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from mtplx_ext.benchmark.provenance import provenance

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "scripts" / "scoreboard.py"


def _load():
    spec = importlib.util.spec_from_file_location("scoreboard", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sb = _load()


def test_the_committed_scoreboard_is_current(capsys):
    """Adding a result with provenance without rerunning the script fails here."""
    assert sb.main(["--check"]) == 0, capsys.readouterr().err


def _result(prov: dict, utc: str, script: str = "bench/scripts/long_context.py", **data) -> dict:
    p = copy.deepcopy(prov)
    p["utc"], p["command"] = utc, [script, "--contexts", "3000", "--json", f"/elsewhere/{utc}.json"]
    return {**data, "provenance": p}


@pytest.fixture()
def board(tmp_path):
    """A results folder and a RESULTS.md with hand-written sections around stale scoreboard text."""
    results = tmp_path / "results"
    results.mkdir()
    shipped = provenance([None])
    rows = json.loads((ROOT / "bench" / "results" / "archive" / "long_context_shipped.json").read_text())["rows"]
    other_head = copy.deepcopy(shipped)
    other_head["models"][0]["head_sha256"] = "0" * 64
    files = {
        "lc_old.json": _result(shipped, "2026-12-06T10:00:00+00:00", rows=rows[:1]),
        "lc_new.json": _result(shipped, "2026-12-07T10:00:00+00:00", rows=rows),
        "lc_other_head.json": _result(other_head, "2026-12-08T10:00:00+00:00", rows=rows),
        "no_provenance.json": {"rows": rows},
    }
    for name, data in files.items():
        (results / name).write_text(json.dumps(data))
    md = tmp_path / "RESULTS.md"
    head, tail = "# Benchmark results\n\nIntro text.\n\n", "\n\n## History\n\nHand-written history.\n"
    md.write_text(head + sb.BEGIN + "\nstale\n" + sb.END + tail)
    return results, md, head, tail


def test_the_scoreboard_keeps_the_newest_result_and_leaves_the_hand_written_text(board):
    results, md, head, tail = board
    assert sb.main(["--check"], results, md) == 1  # stale
    assert sb.main([], results, md) == 0
    text = md.read_text()
    assert text.startswith(head + sb.BEGIN) and text.endswith(sb.END + tail)
    section = text[text.index(sb.BEGIN):text.index(sb.END)]
    assert "1 of the 3 result files with provenance (1 more predate it)" in section
    assert "### long_context.py" in section
    assert "| [`lc_new.json`](results/lc_new.json) | 2026-12-07 |" in section
    assert "ctx 3000 b1 f32: plain 474, K=1 636, K=3 900 tok/s (1.90x)" in section
    assert "- `lc_old.json`: superseded by `lc_new.json`" in section
    assert "- `lc_other_head.json`: measured the shipped model with other weights" in section
    assert "[`lc_old.json`]" not in section and "[`lc_other_head.json`]" not in section
    assert sb.main(["--check"], results, md) == 0  # idempotent


def test_runs_that_differ_in_what_they_measured_both_stay(board):
    results, md, _, _ = board
    data = json.loads((results / "lc_new.json").read_text())
    data["provenance"]["command"] = ["bench/scripts/long_context.py", "--contexts", "64", "--json", "x.json"]
    (results / "lc_short.json").write_text(json.dumps(data))
    sb.main([], results, md)
    assert "[`lc_short.json`]" in md.read_text() and "[`lc_new.json`]" in md.read_text()


def test_headlines_of_the_other_scripts_read_their_real_files():
    def real(name: str) -> dict:
        return json.loads((ROOT / "bench" / "results" / "archive" / name).read_text())

    assert sb.headline("llama_cpp_peer.py", real("llama_cpp_peer_grown.json"))[0] == \
        "F32 b1: llama.cpp 16.8, plain 19.3, MTP K=3 38.4 tok/s"
    assert sb.headline("serve_load.py", real("serve_load_epyc_shipped.json"))[0].startswith("c1: MTP ")
    assert sb.headline("depth_sweep.py", real("depth_sweep_epyc_grown.json")) == [
        "b1: plain 16.4 tok/s, best K=5 42.5 (2.59x)", "b8: plain 119 tok/s, best K=1 130 (1.10x)"]
    assert sb.headline("mtplx-ext bench", real("bench_packed_grown.json"))[0] == "b1: plain 21.1, mtp-auto 50.7 tok/s (2.47x)"
    assert sb.headline("long_context.py", {"rows": [{"oops": 1}]}) == ["(figures not in the expected shape; see the file)"]
    assert sb.headline("fma_peak.py", {}) == []


def test_the_script_and_its_arguments_come_from_the_command():
    assert sb.script_name({"command": ["python/mtplx_ext/cli/__main__.py", "bench", "--json", "a.json"]}) == "mtplx-ext bench"
    assert sb.measured_args({"command": ["s.py", "--json", "a.json", "--rows", "1,8", "--plot=x.png"]}) == ("--rows", "1,8")


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="scoreboard markers"):
        sb.replace_section("# no markers\n", "section")
