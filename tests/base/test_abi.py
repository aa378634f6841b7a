"""The compiled core binds mx.array, and a broken match fails loudly."""

from __future__ import annotations

import importlib.metadata
import types

import mlx.core as mx
import pytest

import mtplx_ext
from mtplx_ext import _abi, _ext


def test_mx_array_arguments_bind_to_the_extension():
    assert _ext.abi_probe(mx.zeros((2, 3, 4))) == 3


def test_extension_was_built_against_the_installed_mlx():
    assert _ext.build_info()["mlx_version"] == importlib.metadata.version("mlx")


def fake_ext(probe_error: Exception | None, mlx_version: str) -> types.ModuleType:
    mod = types.ModuleType("mtplx_ext._ext")

    def abi_probe(a):
        if probe_error is not None:
            raise probe_error
        return a.ndim

    mod.abi_probe = abi_probe
    mod.build_info = lambda: {"mlx_version": mlx_version, "nanobind_version": "9.9.9", "metal": False}
    return mod


def test_binding_mismatch_names_both_versions(monkeypatch):
    broken = fake_ext(TypeError("abi_probe(): incompatible function arguments."), "0.0.1")
    monkeypatch.setattr(mtplx_ext, "_ext", broken)
    with pytest.raises(ImportError) as e:
        _abi.check_extension()
    msg = str(e.value)
    assert "0.0.1" in msg and "9.9.9" in msg and mx.__version__ in msg


def test_mlx_version_mismatch_names_both_versions(monkeypatch):
    monkeypatch.setattr(mtplx_ext, "_ext", fake_ext(None, "0.0.1"))
    with pytest.raises(ImportError) as e:
        _abi.check_extension()
    assert "0.0.1" in str(e.value) and importlib.metadata.version("mlx") in str(e.value)
