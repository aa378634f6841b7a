"""The shipped package carries product code only: no test-only parameters, no broken rules.

The statistical tests prove their power on deliberately broken rules; those
live in the test tree (`tests/_broken_rules.py`), never in a public function
or a kernel a user can reach.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import mtplx_ext
from mtplx_ext import _ext

ROOT = Path(__file__).resolve().parents[1]


def _public_modules():
    for info in pkgutil.walk_packages(mtplx_ext.__path__, "mtplx_ext."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        spec = importlib.util.find_spec(info.name)
        if spec is None or not str(spec.origin).endswith(".py"):  # the extension and the BLAS shim: below
            continue
        yield importlib.import_module(info.name)


def _test_only_parameters(fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p.startswith("_")]


def test_no_public_function_or_method_has_a_test_only_parameter():
    found = []
    for mod in _public_modules():
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{m}", f) for m, f in vars(obj).items()
                            if callable(f) and (not m.startswith("_") or m == "__init__")]
            for label, fn in members:
                if callable(fn):
                    found += [f"{mod.__name__}.{label}({p})" for p in _test_only_parameters(fn)]
    assert not found, found


def test_the_extension_takes_no_rule_switch():
    # nanobind writes each binding's signature at the top of its docstring.
    for name in dir(_ext):
        doc = getattr(getattr(_ext, name), "__doc__", None) or ""
        head = doc.split("\n", 1)[0]
        params = re.findall(r"[(,*]\s*(\w+)\s*:", head)
        assert "variant" not in params and not [p for p in params if p.startswith("_")], (name, head)


def test_the_shipped_kernels_define_no_broken_rule():
    # The sampled rule's sources name no alternative rule to switch to.
    offenders = [str(p.relative_to(ROOT)) for p in [*ROOT.glob("csrc/**/*"), *ROOT.glob("metal/**/*")]
                 if p.is_file() and re.search(r"\bVariant\b|test-only", p.read_text(errors="ignore"))]
    assert not offenders, offenders
