"""`mtplx_ext.engine` (the old name of `mtplx_ext.decode`) stays importable, warns, and is the same modules."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_the_old_package_name_warns_and_aliases_every_module():
    sys.modules.pop("mtplx_ext.engine", None)
    with pytest.warns(DeprecationWarning, match="mtplx_ext.decode"):
        old = importlib.import_module("mtplx_ext.engine")
    import mtplx_ext.decode as new
    import mtplx_ext.decode.constraint as constraint

    assert old.generate_batched is new.generate_batched
    assert importlib.import_module("mtplx_ext.engine.constraint") is constraint
    from mtplx_ext.engine.autodepth import AUTO  # noqa: F401  (the from-import form too)
