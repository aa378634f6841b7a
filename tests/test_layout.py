"""The package's architecture as a test: one-way imports between layers, no cycles, small modules.

The layer order is stated once, here (docs/architecture.md's Layers section
describes it): a module may import its own layer and the layers below it,
never a layer above, and the import graph of the package's modules has no
cycle (imports inside functions count: a deferred import is still a
dependency). `mtplx_ext/__init__.py` is the facade over everything and is
not a layer. Tests and bench scripts use public names only: no `_private`
function, class or attribute of the package (the extension `_ext` and the
other layer-0 modules are the layer under test where tests call them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "mtplx_ext"

#: Bottom first. Components in one entry form one layer.
LAYERS: list[set[str]] = [
    {"_blas", "_abi", "_ext", "_checks", "shipped"},
    {"sampling"},
    {"ops"},
    {"cache"},
    {"models"},
    {"checkpoints"},
    {"decode", "engine"},  # engine: the deprecated name of decode
    {"batching"},
    {"serve"},
    {"train"},
    {"benchmark"},
    {"cli"},
]
LAYER_OF = {c: i for i, layer in enumerate(LAYERS) for c in layer}
#: The package's own L0 modules that tests may use directly.
LAYER0_MODULES = {"_ext", "_abi", "_blas", "_checks"}
MAX_LINES = 500


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _is_module(name: str, mods: dict[str, Path]) -> bool:
    return name in mods or name in {"mtplx_ext._ext"}


def _imports(path: Path, name: str, mods: dict[str, Path]) -> set[str]:
    """The package modules `path` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "mtplx_ext")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "mtplx_ext":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if _is_module(sub, mods) else base)
    return out


def _component(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the facade


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(path, name, mods) for name, path in mods.items()}


def test_every_component_has_a_layer():
    comps = {_component(m) for m in _modules()} - {None}
    assert comps <= set(LAYER_OF), f"add to LAYERS: {sorted(comps - set(LAYER_OF))}"


def test_imports_point_down():
    bad = []
    for mod, deps in _graph().items():
        src = _component(mod)
        if src is None:
            continue  # the facade
        for dep in deps:
            dst = _component(dep)
            if dst is None:
                bad.append(f"{mod} imports the facade mtplx_ext (import the module it needs)")
            elif LAYER_OF[dst] > LAYER_OF[src]:
                bad.append(f"{mod} (layer {LAYER_OF[src]}) imports {dep} (layer {LAYER_OF[dst]})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The two checks above can fail: a fake package with both faults."""
    fake = tmp_path / "mtplx_ext"
    (fake / "ops").mkdir(parents=True)
    (fake / "decode").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "ops" / "__init__.py").write_text("")
    (fake / "decode" / "__init__.py").write_text("")
    (fake / "ops" / "a.py").write_text("def f():\n    from mtplx_ext.decode import b\n")
    (fake / "decode" / "b.py").write_text("from mtplx_ext.ops import a\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    with pytest.raises(AssertionError, match="ops.a .layer 2. imports mtplx_ext.decode.b"):
        test_imports_point_down()
    with pytest.raises(AssertionError, match="mtplx_ext.decode.b -> mtplx_ext.ops.a -> mtplx_ext.decode.b"):
        test_no_import_cycle()


def test_no_module_is_over_the_line_limit():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: dict[str, str] = {}  # local name -> package module it is bound to
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mtplx_ext"):
            for a in node.names:
                last = a.name
                if last.startswith("_") and last not in LAYER0_MODULES:
                    out.append(f"{path.name}:{node.lineno}: imports {node.module}.{last}")
                names[a.asname or last] = f"{node.module}.{last}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mtplx_ext"):
                    names[(a.asname or a.name).split(".")[0]] = a.asname and a.name or "mtplx_ext"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in names and node.attr not in LAYER0_MODULES:
                out.append(f"{path.name}:{node.lineno}: uses {names[base.id]}.{node.attr}")
    return out


def test_tests_and_bench_use_public_names_only():
    files = [p for p in (ROOT / "tests").rglob("*.py") if "metal_shim" not in p.parts and p.name != Path(__file__).name]
    files += list((ROOT / "bench").rglob("*.py"))
    bad = [u for f in files for u in _private_uses(f)]
    assert not bad, "\n".join(bad)


def test_public_names_stay_importable_and_moved_ones_warn():
    import mtplx_ext
    from mtplx_ext.models import mlx_lm_patches

    for name in mtplx_ext.__all__:
        assert getattr(mtplx_ext, name) is not None, name
    with pytest.warns(DeprecationWarning, match="mtplx_ext.models.mlx_lm_patches"):
        moved = mtplx_ext.patch_mlx_lm_ops
    assert moved is mlx_lm_patches.patch_mlx_lm_ops
    # The runtime's building blocks left `__all__` (it holds what users call); they still import, warning.
    from mtplx_ext.models import packed_linear

    assert "PackedLinear" not in mtplx_ext.__all__ and {"load", "Engine", "verify_sampled_chain"} <= set(mtplx_ext.__all__)
    with pytest.warns(DeprecationWarning, match="mtplx_ext.models.packed_linear"):
        assert mtplx_ext.PackedLinear is packed_linear.PackedLinear
    with pytest.raises(AttributeError, match="no_such_name"):
        mtplx_ext.no_such_name  # noqa: B018
