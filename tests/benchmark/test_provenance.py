"""Benchmark provenance: what a result file records about its run, and that every JSON-writing script records it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtplx_ext.benchmark import provenance as prov
from mtplx_ext.benchmark.provenance import EDGE_BYTES, git_state, provenance, source_checkout, weights_hash

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "bench" / "scripts"


def _folder(path: Path, trunk: bytes, head: bytes = b"head", config: str = '{"model_type": "qwen3"}') -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(trunk)
    (path / "mtp.safetensors").write_bytes(head)
    (path / "config.json").write_text(config)
    return path


def test_the_record_has_every_field_and_is_json():
    p = provenance([None])
    assert set(p) >= {"commit", "dirty", "cpu", "cores", "usable_cores", "versions", "blas", "command", "utc", "models"}
    assert set(p["versions"]) == {"python", "mlx", "mlx-lm", "mtplx-ext", "numpy"}
    assert p["versions"]["mlx"] != "not installed" and p["cores"] >= 1 and isinstance(p["cpu"], str)
    assert p["command"][1:] == sys.argv[1:]
    assert p["models"][0]["path"].endswith("tiny-qwen3-mtp") and p["models"][0]["head_sha256"]
    assert json.loads(json.dumps(p)) == p


def test_the_commit_is_the_checkout_the_package_runs_from():
    commit, dirty = git_state()
    root = source_checkout()
    if root is None:  # an installed package: nothing to credit
        assert (commit, dirty) == (None, None)
        return
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert commit == head and re.fullmatch(r"[0-9a-f]{40}", commit) and isinstance(dirty, bool)


def test_a_package_outside_its_checkout_records_no_commit(monkeypatch, tmp_path):
    """An installed copy inside some other repository (a virtual environment in a project) is not credited to it."""
    monkeypatch.setattr(prov, "_git", lambda root, *args: str(tmp_path) if "--show-toplevel" in args else "f" * 40)
    assert source_checkout() is None and git_state() == (None, None)
    monkeypatch.setattr(prov, "_git", lambda root, *args: None)  # no git, or not a checkout
    assert git_state() == (None, None)


def test_the_weights_hash_follows_the_bytes_not_the_file_times(tmp_path, rng):
    trunk = rng.integers(0, 256, 3 * EDGE_BYTES + 17, dtype=np.uint8).tobytes()
    a = _folder(tmp_path / "a", trunk)
    b = _folder(tmp_path / "b", trunk)
    os.utime(b / "model.safetensors", (1, 1))
    assert weights_hash(a)["sha256"] == weights_hash(b)["sha256"]  # a regrown copy of the same weights

    edited = bytearray(trunk)
    edited[-1] ^= 1
    c = _folder(tmp_path / "c", bytes(edited))
    assert weights_hash(c)["sha256"] != weights_hash(a)["sha256"]  # the end of the data is read

    new_head = _folder(tmp_path / "d", trunk, head=b"another head")
    assert weights_hash(new_head)["head_sha256"] != weights_hash(a)["head_sha256"]
    assert weights_hash(new_head)["sha256"] != weights_hash(a)["sha256"]


def test_the_fast_hash_misses_the_middle_of_a_large_file_and_the_full_one_does_not(tmp_path, rng):
    """The documented limit of the fast method, and the way around it."""
    trunk = rng.integers(0, 256, 3 * EDGE_BYTES, dtype=np.uint8).tobytes()
    middle = bytearray(trunk)
    middle[len(trunk) // 2] ^= 1
    a, b = _folder(tmp_path / "a", trunk), _folder(tmp_path / "b", bytes(middle))
    assert weights_hash(a)["sha256"] == weights_hash(b)["sha256"]
    assert weights_hash(a, full=True)["sha256"] != weights_hash(b, full=True)["sha256"]
    assert weights_hash(a, full=True)["method"] == "full" and weights_hash(a)["method"] == "edges-1MiB"


def test_a_missing_model_is_recorded_as_an_error(tmp_path):
    with pytest.raises(NotADirectoryError):
        weights_hash(tmp_path / "missing")
    (entry,) = provenance([tmp_path / "missing"])["models"]
    assert "error" in entry and "sha256" not in entry


def without_provenance(scripts: dict[str, str]) -> list[str]:
    """The scripts (name -> source) that take --json but never call `provenance(...)`."""
    return [n for n, t in scripts.items() if re.search(r"add_argument\(\s*\"--json\"", t) and "provenance(" not in t]


def test_every_bench_script_that_writes_json_records_provenance():
    scripts = {p.name: p.read_text() for p in sorted(SCRIPTS.glob("*.py"))}
    assert sum('"--json"' in t for t in scripts.values()) >= 14
    assert not without_provenance(scripts), "bench scripts writing --json without provenance"
    fake = {"old.py": 'ap.add_argument("--json", type=Path)\njson.dump(report, f)',
            "new.py": 'ap.add_argument("--json")\nreport["provenance"] = provenance([a.model])',
            "no_json.py": "print(1)"}
    assert without_provenance(fake) == ["old.py"]


def test_every_current_result_says_where_it_came_from():
    # Results recorded before provenance live in bench/results/archive/; everything else names its commit and CPU.
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    missing = [p.name for p in sorted(results.glob("*.json"))
               if not {"commit", "cpu"} <= set((json.loads(p.read_text()).get("provenance") or {}))]
    assert not missing, missing
