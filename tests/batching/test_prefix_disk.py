"""The prefix cache's disk tier: blocks and states survive a restart, damaged or foreign files are skipped
(one log line, a correct reply), and the directory stays under its cap."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from safetensors import safe_open

import mtplx_ext
from mtplx_ext.batching import Engine
from mtplx_ext.batching.prefix_disk import FORMAT
from _greedy import check_stream, reference

MB = 1 << 20
HYBRID = Path(__file__).resolve().parents[2] / "bench" / "models" / "tiny-qwen3-next-mtp"


@pytest.fixture(scope="module")
def hybrid():
    return mtplx_ext.load(HYBRID)


def _engine(rt, d: Path, **kw) -> Engine:
    return Engine(rt, max_batch=1, depth=2, prefix_cache_bytes=64 * MB, prefix_block_tokens=16,
                  prefix_cache_dir=d, **kw)


def _run(eng: Engine, prompt, **kw):
    r = eng.submit(prompt, **kw)
    eng.run_until_idle()
    assert r.finish_reason in ("stop", "length"), r.error
    return r


def _first_turn(rt, d: Path, rng) -> tuple[list[int], list[int]]:
    """Turn 1 on an engine over `d`, its files written; (turn 1's prompt, turn 2's prompt)."""
    eng = _engine(rt, d)
    base = rng.integers(0, rt.vocab_size, 60).tolist()
    first = _run(eng, base, max_tokens=4)
    eng.prefix.flush()
    return base, base + first.tokens + rng.integers(0, rt.vocab_size, 7).tolist()


def _check_turn(rt, turn: list[int], r) -> None:
    ref, gaps = reference(rt, turn, 10)
    check_stream(0, r, ref, gaps, set(), 10)


def test_a_new_engine_over_the_same_directory_resumes_from_its_files(hybrid, rng, tmp_path):
    base, turn = _first_turn(hybrid, tmp_path, rng)
    files = sorted(tmp_path.iterdir())
    assert files and not [f for f in files if f.name.endswith(".tmp")]
    for f in files:  # plain safetensors, read by the reference parser
        with safe_open(str(f), framework="numpy") as st:
            assert st.metadata()["format"] == FORMAT and len(list(st.keys())) > 0
    eng = _engine(hybrid, tmp_path)  # "after a restart": a fresh engine and RAM tier
    assert eng.metrics()["prefix_bytes"] == 0 and eng.metrics()["prefix_entries_disk"] == len(files)
    r = _run(eng, turn, max_tokens=10)
    m = eng.metrics()
    assert m["prefix_hits"] == 1 and m["prefix_disk_hits"] >= 2 and m["prefix_tokens_reused"] >= len(base)
    assert m["prefill_tokens"] <= len(turn) - len(base)
    _check_turn(hybrid, turn, r)


def _damage(kind: str, path: Path, foreign: Path) -> None:
    data = path.read_bytes()
    if kind == "flip":
        i = len(data) - 5  # a byte of the last tensor's data
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :])
    elif kind == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # another model's file of the same kind, under this model's name
        path.write_bytes(foreign.read_bytes())


@pytest.mark.parametrize("target", ["state", "node"])
@pytest.mark.parametrize("kind", ["flip", "truncate", "foreign"])
def test_a_damaged_or_foreign_file_is_skipped_and_the_reply_stays_right(hybrid, rng, tmp_path, caplog, kind,
                                                                        target):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    base, turn = _first_turn(hybrid, mine, rng)
    other = mtplx_ext.init_random("qwen3_next", seed=3, hidden_size=128, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=64, vocab_size=hybrid.vocab_size)
    _first_turn(other, theirs, rng)
    prefix = "s-" if target == "state" else "n-"
    victim = sorted(f for f in mine.iterdir() if f.name.startswith(prefix))[0]
    donor = sorted(f for f in theirs.iterdir() if f.name.startswith(prefix))[0]
    _damage(kind, victim, donor)
    eng = _engine(hybrid, mine)
    with caplog.at_level(logging.WARNING, logger="mtplx_ext.prefix_cache"):
        r = _run(eng, turn, max_tokens=10)
    lines = [rec for rec in caplog.records if rec.name == "mtplx_ext.prefix_cache"]
    assert len(lines) == 1 and victim.name in lines[0].getMessage(), [x.getMessage() for x in lines]
    assert eng.metrics()["prefix_disk_skipped"] == 1
    _check_turn(hybrid, turn, r)
    eng.prefix.flush()  # the bad file is gone (or rewritten by this turn's store): the next restart skips nothing
    again = _engine(hybrid, mine)
    _run(again, turn + r.tokens + [1, 2, 3], max_tokens=2)
    assert again.metrics()["prefix_disk_skipped"] == 0 and again.metrics()["prefix_tokens_reused"] >= len(turn)


def test_the_directory_stays_under_its_cap(hybrid, rng, tmp_path):
    probe = tmp_path / "probe"
    _first_turn(hybrid, probe, rng)
    one = sum(f.stat().st_size for f in probe.iterdir())
    cap = int(one * 2.5)
    eng = _engine(hybrid, tmp_path / "capped", prefix_cache_disk_bytes=cap)
    for _ in range(4):
        _run(eng, rng.integers(0, hybrid.vocab_size, 60).tolist(), max_tokens=4)
    eng.prefix.flush()
    m = eng.metrics()
    assert sum(f.stat().st_size for f in (tmp_path / "capped").iterdir()) == m["prefix_bytes_disk"] <= cap
    assert m["prefix_disk_evictions"] > 0 and m["prefix_disk_writes"] > m["prefix_entries_disk"]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prefix_cache_dir=7), "prefix_cache_dir"),
    (dict(prefix_cache_dir="FILE"), "prefix_cache_dir"),
    (dict(prefix_cache_dir="UNDER_FILE"), "prefix_cache_dir"),
    (dict(prefix_cache_disk_bytes=-1), "prefix_cache_disk_bytes"),
    (dict(prefix_block_tokens=0), "prefix_block_tokens"),
])
def test_bad_disk_tier_arguments_are_refused_naming_them(shipped, tmp_path, kwargs, needle):
    f = tmp_path / "a-file"
    f.write_text("x")
    kwargs = {k: {"FILE": f, "UNDER_FILE": f / "sub"}.get(v, v) if isinstance(v, str) else v
              for k, v in kwargs.items()}
    with pytest.raises((TypeError, ValueError), match=needle):
        Engine(shipped, max_batch=1, depth=1, prefix_cache_bytes=MB, **kwargs)


def test_the_serve_cli_and_build_api_hand_the_disk_tier_to_the_engine(tmp_path, capsys):
    from _serve import cli_serve_args

    from mtplx_ext import cli
    from mtplx_ext.serve import build_api

    runtime, folder, kwargs = cli_serve_args("--depth", "1", "--prefix-cache-dir", str(tmp_path),
                                             "--prefix-cache-disk-bytes", "10M")
    assert kwargs["prefix_cache_dir"] == str(tmp_path) and kwargs["prefix_cache_disk_bytes"] == 10 << 20
    api = build_api(runtime, folder, depth=1, prefix_cache_dir=kwargs["prefix_cache_dir"],
                    prefix_cache_disk_bytes=kwargs["prefix_cache_disk_bytes"])
    disk = api.engine.prefix.disk
    assert disk is not None and disk.dir == tmp_path and disk.max_bytes == 10 << 20
    api.engine.prefix.close()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error, naming the flag
        cli.main(["serve", "--port", "0", "--prefix-cache-disk-bytes", "lots"])
    assert exit_.value.code == 2 and "--prefix-cache-disk-bytes" in capsys.readouterr().err.splitlines()[-1]
