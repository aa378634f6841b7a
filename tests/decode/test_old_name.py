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

    assert old.generate_reference is new.generate_reference
    assert importlib.import_module("mtplx_ext.engine.constraint") is constraint
    from mtplx_ext.engine.autodepth import AUTO  # noqa: F401  (the from-import form too)


def test_the_old_fixed_batch_names_of_decode_warn_and_name_the_reference_loop():
    import mtplx_ext
    import mtplx_ext.decode as decode

    with pytest.warns(DeprecationWarning, match="reference loop"):
        old = decode.generate_batched
    assert old is decode.generate_reference and old is not mtplx_ext.generate_batched
    with pytest.raises(AttributeError):
        decode.no_such_name  # noqa: B018
