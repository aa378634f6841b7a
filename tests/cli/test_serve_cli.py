"""`mtplx-ext serve`'s own checks: what fails before the model loads is one `mtplx-ext: error:` line, status 2."""

from __future__ import annotations

import socket

import pytest

from mtplx_ext import cli
from mtplx_ext.cli import common as cli_common


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded")


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(cli_common, "load_model", _no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mtplx-ext: error: cannot listen on 127.0.0.1:"), err
    assert str(port) in err and "in use" in err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--shutdown-grace", "-1"], "--shutdown-grace"),
        (["--shutdown-grace", "nan"], "--shutdown-grace"),
        (["--max-body-mb", "0"], "--max-body-mb"),
        (["--max-body-mb", "inf"], "--max-body-mb"),
        (["--host", "256.1.1.1"], "cannot listen on 256.1.1.1"),
    ],
)
def test_bad_serve_flags_are_one_line_before_the_model_loads(flags, needle, capsys, monkeypatch):
    monkeypatch.setattr(cli_common, "load_model", _no_model)
    assert cli.main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mtplx-ext: error:") and needle in err, err


def test_the_cli_passes_serve_its_own_defaults_and_loads_no_http_stack_to_parse_them(monkeypatch):
    import inspect
    import subprocess
    import sys

    from mtplx_ext.serve import server

    params = inspect.signature(server.serve).parameters
    got = {}

    def fake_serve(rt, folder, **kw):
        got.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(cli_common, "load_model", lambda *a, **k: object())
    monkeypatch.setattr(server, "serve", fake_serve)
    monkeypatch.setattr(server, "bind", lambda host, port: socket.socket())
    assert cli.main(["serve", "--no-mtp"]) == 2
    for name in ("max_batch", "prefill_chunk", "prefix_cache_bytes", "shutdown_grace", "max_body_bytes"):
        assert got[name] == params[name].default, name
    # The parser (and its help) reads the defaults without starlette or uvicorn.
    code = ("import sys, argparse, mtplx_ext.cli.serve as s; s.add_parser(argparse.ArgumentParser().add_subparsers()); "
            "print('starlette' in sys.modules or 'uvicorn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
