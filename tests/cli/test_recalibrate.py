"""`--depth auto` on the command line: the calibration key is reported, and `--recalibrate` measures anew."""

from __future__ import annotations

import pytest

import mtplx_ext
from mtplx_ext import cli
from mtplx_ext.decode import autodepth
from mtplx_ext.decode.autodepth import DepthCosts
from mtplx_ext.shipped import SHIPPED_MODEL


@pytest.fixture()
def counted(tmp_path, monkeypatch):
    """An empty calibration cache, no recalibration asked for, and a fake `calibrate` choosing depth 2."""
    monkeypatch.setenv("MTPLX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MTPLX_RECALIBRATE", raising=False)
    monkeypatch.setattr(autodepth, "_MEMORY", {})
    monkeypatch.setattr(autodepth, "_REMEASURED", set())
    monkeypatch.setattr(autodepth, "_FORCE", False)
    calls: list[int] = []

    def fake(runtime, batch, decode, max_depth=autodepth.MAX_AUTO_DEPTH, tokens=autodepth.CALIBRATION_TOKENS):
        calls.append(batch)
        return DepthCosts(batch=batch, cycle_s={"0": 1.0, "1": 0.8, "2": 0.7, "3": 5.0}, acceptance=[0.9, 0.9, 0.9])

    monkeypatch.setattr(autodepth, "calibrate", fake)
    return calls


def test_generate_reports_the_key_and_recalibrates_on_request(counted, capsys):
    key = autodepth.calibration_key(mtplx_ext.load(SHIPPED_MODEL))
    assert cli.main(["generate", "def f(", "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert f"MTP depth 2 (auto, calibration key {key} (kept in" in err
    assert counted == [1]
    assert cli.main(["generate", "def g(", "--max-tokens", "4"]) == 0
    assert counted == [1]  # this process's memory
    assert cli.main(["generate", "def h(", "--max-tokens", "4", "--recalibrate"]) == 0
    assert counted == [1, 1]
    assert f"calibration key {key} (measured anew)" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["generate", "serve", "bench"])
def test_every_verb_with_depth_auto_takes_recalibrate(verb, capsys):
    with pytest.raises(SystemExit):
        cli.main([verb, "--help"])
    assert "--recalibrate" in capsys.readouterr().out
