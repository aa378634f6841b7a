"""The `mtplx-ext` command on the shipped model: short runs and clear errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest

import _seed

import mtplx_ext
from mtplx_ext import cli
from mtplx_ext.shipped import EOS_TOKEN, SHIPPED_MODEL
from mtplx_ext import benchmark
from mtplx_ext.cli import common as cli_common

# The subprocess imports the same mtplx_ext as this process: the installed
# package in CI, the source tree under PYTHONPATH=python in development.
PYTHON_DIR = str(Path(mtplx_ext.__file__).resolve().parents[1])


def _random_prompt(rng: random.Random) -> str:
    name = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
    return rng.choice(["def {}(self, ", "class {}:\n    ", "    {} = ", "import {}\n"]).format(name)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "mtplx_ext.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_generate_command_streams_the_committed_text_and_reports_stats():
    prompt = _random_prompt(random.Random(_seed.fresh()))
    p = _run_cli("generate", prompt, "--max-tokens", "12")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(prompt)
    rt = mtplx_ext.load(SHIPPED_MODEL)
    ids = rt.tokenizer.encode(prompt).ids
    eos = rt.tokenizer.token_to_id(EOS_TOKEN)
    res = mtplx_ext.generate_greedy_batched(rt, [ids], max_new_tokens=12, stop_token_ids=[eos], depth=1)
    # What streamed is exactly the decode of what the loop committed.
    assert p.stdout == prompt + rt.tokenizer.decode(res.streams[0].tokens) + "\n"
    for word in ("tokens/s", "acceptance", "forwards/token", "BLAS openblas" if sys.platform.startswith("linux") else "BLAS"):
        assert word in p.stderr
    # Prefill and decode are reported apart (the prompt's tokens counted in the first).
    assert f"prefill: {len(ids)} prompt tokens in " in p.stderr and "; decode: " in p.stderr


def test_generate_decodes_several_prompts_as_one_batch(capsys):
    rng = random.Random(_seed.fresh())
    prompts = [_random_prompt(rng) for _ in range(3)]
    assert cli.main(["generate", *prompts, "--max-tokens", "10"]) == 0
    out, err = capsys.readouterr()
    for i, p in enumerate(prompts):
        assert f"[{i}] prompt: {p!r}" in out
    assert "batch 3" in err


def test_generate_no_mtp_reports_plain_decoding(capsys):
    assert cli.main(["generate", _random_prompt(random.Random(_seed.fresh())), "--max-tokens", "6", "--no-mtp"]) == 0
    _, err = capsys.readouterr()
    assert "plain decoding" in err


def test_bench_reports_every_method_at_every_batch(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--batch", "1,2", "--tokens", "16", "--repeats", "1", "--json", str(out), "--no-progress"])
    assert code == 0
    table, _ = capsys.readouterr()
    report = json.loads(out.read_text())
    got = {(r["batch"], r["method"]) for r in report["rows"]}
    assert got == {(b, m) for b in (1, 2) for m in benchmark.METHODS}
    for r in report["rows"]:
        assert r["tokens_per_s"] > 0
        assert f"| {r['batch']} | {r['method']} |" in table
        if r["method"] == "mtp":
            assert 0.0 <= r["acceptance_rate"] <= 1.0
            assert r["forwards_per_token"] > 0
    plain = [r for r in report["rows"] if r["method"] == "plain"]
    assert all(r["ratio_to_plain"] == pytest.approx(1.0) for r in plain)
    assert report["versions"]["blas"] and "BLAS:" in table
    engine = [r for r in report["rows"] if r["method"] != "mlx-lm"]
    assert all(r["compiled"] for r in engine) and "engine decode steps: compiled" in table


def test_bench_plot_is_written_or_skipped_with_a_message(tmp_path, capsys):
    png = tmp_path / "bench.png"
    assert cli.main(["bench", "--batch", "1", "--tokens", "4", "--repeats", "1", "--plot", str(png), "--no-progress"]) == 0
    _, err = capsys.readouterr()
    if png.exists():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "--plot skipped" in err


def test_missing_model_folder_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    assert cli.main(["generate", "x", "--model", str(missing)]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and str(missing) in err and "does not exist" in err


def test_folder_without_mtp_weights_is_a_one_line_error_naming_no_mtp(tmp_path, capsys):
    rt = mtplx_ext.load(SHIPPED_MODEL)
    cfg = {k: rt.config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "intermediate_size", "head_dim")}
    plain = mtplx_ext.init_random("qwen3", random.randrange(1 << 30), head_layout=None, **cfg)
    folder = tmp_path / "trunk_only"
    plain.save(folder)
    shutil.copy(SHIPPED_MODEL / "tokenizer.json", folder / "tokenizer.json")
    for cmd in (["generate", "x"], ["bench", "--tokens", "2"]):
        assert cli.main([*cmd, "--model", str(folder)]) == 2
        _, err = capsys.readouterr()
        assert err.count("\n") == 1 and "no MTP head weights" in err
    # The same folder decodes plainly.
    assert cli.main(["generate", "x", "--model", str(folder), "--max-tokens", "3", "--no-mtp"]) == 0


def test_folder_without_weights_or_config_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["generate", "--model", str(tmp_path / "empty")]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "config.json" in err
    shutil.copy(SHIPPED_MODEL / "config.json", tmp_path / "empty" / "config.json")
    assert cli.main(["generate", "--model", str(tmp_path / "empty")]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "safetensors" in err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["bench", "--batch", "1,x"], "--batch"),
        (["bench", "--batch", "0"], "--batch"),
        (["bench", "--tokens", "-3"], "--tokens"),
        (["bench", "--repeats", "0"], "--repeats"),
        (["generate", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "--top-p", "1.5"], "--top-p"),
        (["generate", "--top-k", "-1"], "--top-k"),
        (["generate", "--temperature", "-0.1"], "--temperature"),
        (["generate", "--bogus"], "--bogus"),
        # Past float32 or the kernels' ranges, and seeds outside [0, 2**64).
        (["generate", "--temperature", "inf"], "--temperature"),
        (["generate", "--temperature", "1e39"], "--temperature"),
        (["generate", "--temperature", "1e-50"], "--temperature"),
        (["generate", "--top-p", "1e-50"], "--top-p"),
        (["generate", "--top-k", "99999999"], "--top-k"),
        (["generate", "--seed", "-1"], "--seed"),
        (["generate", "--seed", str(2**64)], "--seed"),
        (["generate", "--seed", "1.5"], "--seed"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    _, err = capsys.readouterr()
    assert flag in err.splitlines()[-1]


def test_prompt_that_is_not_utf8_is_a_one_line_error_naming_the_prompt(capsys, monkeypatch):
    # Undecodable argv bytes reach Python as lone surrogates (os.fsdecode).
    bad = os.fsdecode(b"def f(\xff\xfe):")
    monkeypatch.setattr(cli_common, "load_model", lambda *a, **k: pytest.fail("loaded the model before checking the prompt"))
    assert cli.main(["generate", "import os", bad]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "prompt 1 is not UTF-8" in err and "0xff" in err


@pytest.mark.parametrize("command", [["generate", "x", "--max-tokens", "2"], ["bench", "--tokens", "2"]])
def test_closed_stdout_is_a_one_line_error_before_any_work(command, capsys, monkeypatch):
    monkeypatch.setattr(cli_common, "load_model", lambda *a, **k: pytest.fail("loaded the model with stdout closed"))
    monkeypatch.setattr(sys, "stdout", None)  # what Python sets when fd 1 is closed at start
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "standard output is closed" in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_stdout_is_a_one_line_error(capsys, monkeypatch):
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert cli.main(["generate", _random_prompt(random.Random(_seed.fresh())), "--max-tokens", "3", "--enforce-eager"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "mtplx-ext: error: cannot write to standard output: No space left on device"


def test_stdout_reader_that_went_away_ends_the_command_quietly():
    # As in `mtplx-ext generate ... | head -c 10`: writes to the pipe fail with EPIPE.
    r, w = os.pipe()
    os.close(r)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(
            [sys.executable, "-m", "mtplx_ext.cli", "generate", "x", "--max-tokens", "8", "--enforce-eager"],
            stdout=w, stderr=subprocess.PIPE, env=env, text=True, timeout=120,
        )
    finally:
        os.close(w)
    assert p.returncode == 141, p.stderr
    assert "Traceback" not in p.stderr and "Error" not in p.stderr and "Exception" not in p.stderr, p.stderr


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_output_path_that_cannot_be_written_fails_before_the_run(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_common, "load_model", lambda *a, **k: pytest.fail("bench ran with an unwritable output path"))
    for bad in (tmp_path / "no_such_folder" / "out", tmp_path):
        assert cli.main(["bench", "--tokens", "2", flag, str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err and str(bad) in err and "cannot be written" in err
    # A writable path is checked without leaving a file behind when the run then fails.
    ok = tmp_path / "out"
    monkeypatch.setattr(cli_common, "load_model", lambda *a, **k: (_ for _ in ()).throw(cli_common.CLIError("stopped")))
    assert cli.main(["bench", "--tokens", "2", flag, str(ok)]) == 2
    assert "stopped" in capsys.readouterr().err and not ok.exists()


def test_sampled_generate_is_reproducible_for_a_seed(capsys):
    rng = random.Random(_seed.fresh())
    argv = ["generate", _random_prompt(rng), "--max-tokens", "12", "--temperature", "0.8",
            "--top-p", "0.95", "--top-k", "50", "--seed", str(rng.randrange(1 << 30))]
    outs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


def test_generate_says_when_mlx_must_first_build_its_kernels(tmp_path, capsys, monkeypatch):
    import tempfile

    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("MLX builds kernels with the C++ compiler only on its CPU backend")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli_common.mlx_kernel_cache_is_cold()
    assert cli.main(["generate", "--max-tokens", "2", "--enforce-eager", "x"]) == 0
    assert "first compiled decode" not in capsys.readouterr().err  # nothing to build when eager
    kernels = tmp_path / "mlx" / mx.__version__ / "cpu"
    kernels.mkdir(parents=True)
    (kernels / "libkernel.so").write_bytes(b"")
    assert not cli_common.mlx_kernel_cache_is_cold()
    monkeypatch.setattr(cli_common, "mlx_kernel_cache_is_cold", lambda: True)
    assert cli.main(["generate", "--max-tokens", "2", "x"]) == 0
    assert "first compiled decode on this machine" in capsys.readouterr().err


def test_generate_refuses_a_request_beyond_the_context_with_the_servers_rule(capsys, monkeypatch):
    rt = mtplx_ext.load(SHIPPED_MODEL)
    monkeypatch.setattr(cli_common, "load_model", lambda *a, **k: rt)
    ctx = rt.config["max_position_embeddings"]
    rng = random.Random(_seed.fresh())
    long_text = " ".join(_random_prompt(rng) for _ in range(ctx // 2))
    n_long = len(rt.tokenizer.encode(long_text).ids)
    assert n_long > ctx
    eng = mtplx_ext.Engine(rt, max_batch=1, depth=1)
    for argv, n_prompt, max_tokens in (
        (["generate", "def f(", "--max-tokens", str(ctx + 1)], len(rt.tokenizer.encode("def f(").ids), ctx + 1),
        (["generate", long_text, "--max-tokens", "4"], n_long, 4),
    ):
        with pytest.raises(ValueError) as server:
            eng.submit([1] * n_prompt, max_tokens=max_tokens)
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"mtplx-ext: error: {server.value}\n", err
    # Within the context it decodes.
    assert cli.main(["generate", "def f(", "--max-tokens", "4"]) == 0
