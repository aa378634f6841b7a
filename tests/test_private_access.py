"""No module reaches into another object's private attributes.

A `_name` belongs to the object (or class) that defines it: code reads and
writes it through `self`, `cls` or `super()` only. Everything else goes
through a public name, so a class can change its insides without breaking a
caller it cannot see. Two exceptions: `os._exit` (the standard library's
public way to exit without cleanup), and mlx-lm's internals, read in one
adapter module (`models/mlx_lm_internals.py`) that says why for each.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "python" / "mtplx_ext"
ADAPTER = PKG / "models" / "mlx_lm_internals.py"
ALLOWED = {("os", "_exit")}
OWN = {"self", "cls"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _owner_ok(node: ast.expr) -> bool:
    if isinstance(node, ast.Name) and node.id in OWN:
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def foreign_private_access(source: str) -> list[str]:
    """`x._name` (and getattr / setattr / hasattr / delattr of a "_name") on an object other than self / cls /
    super(), as "line: expression"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target, name = None, None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            target, name = node.args[0], node.args[1].value
        if target is None or _owner_ok(target):
            continue
        if isinstance(target, ast.Name) and (target.id, name) in ALLOWED:
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checker_catches_each_kind_of_foreign_access():
    src = ("class A:\n"
           "    def f(self, other):\n"
           "        self._ok = 1\n"
           "        super()._ok2()\n"
           "        other._bad = 2\n"
           "        return getattr(other, '_worse', None), os._exit, other.__dict__\n"
           "    @classmethod\n"
           "    def g(cls, x):\n"
           "        return cls._fine, x._nope, setattr(x, '_also', 1)\n")
    bad = foreign_private_access(src)
    assert [b.split(":")[0] for b in bad] == ["5", "6", "9", "9"], bad


def test_no_module_reads_or_writes_another_objects_private_attributes():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if path == ADAPTER:
            continue
        offenders += [f"{path.relative_to(PKG)}:{hit}" for hit in foreign_private_access(path.read_text())]
    assert not offenders, "\n".join(offenders)
