"""Turns a Metal kernel file into C++ that compiles against metal_shim.h.

The real ``metal/*.metal`` source is what gets compiled: it is run through
clang's preprocessor (includes and macros expanded, ``<metal_stdlib>`` and
friends replaced by empty stand-ins), then a small set of mechanical rewrites
maps Metal's address spaces onto the shim's checked pointer classes, records
each kernel's parameter bindings from its ``[[...]]`` attributes, and strips
those attributes. Line markers are kept, so compiler errors point at the
original Metal files.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent
FAKE_INCLUDE = SHIM_DIR / "fake_include"

#: Metal attributes that bind a kernel parameter to a thread/grid value.
ATTRIBUTES = (
    "thread_position_in_grid",
    "threadgroup_position_in_grid",
    "thread_position_in_threadgroup",
    "thread_index_in_threadgroup",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "threads_per_simdgroup",
    "thread_execution_width",
)

_STRIP_ATTRS = re.compile(
    r"\[\[\s*(?:kernel|host_name\s*\([^)]*\)|buffer\s*\(\s*\d+\s*\)"
    r"|threadgroup\s*\(\s*\d+\s*\)|max_total_threads_per_threadgroup\s*\([^)]*\)"
    r"|" + "|".join(ATTRIBUTES) + r")\s*\]\]"
)
_INSTANTIATION = re.compile(
    r"template\s*\[\[\s*host_name\s*\(\s*((?:\"[^\"]*\"\s*)+)\)\s*\]\]\s*"
    r"\[\[\s*kernel\s*\]\]\s*decltype\s*\(\s*([\w:]+)\s*<(.*?)>\s*\)\s*"
    r"([\w:]+)\s*<(.*?)>\s*;"
)
_KERNEL = re.compile(r"\[\[\s*kernel\s*\]\]\s*void\s+(\w+)\s*\(")
_PARAM_ATTR = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]")
_TYPE = r"[^*&;(){}\[\],=]+?"
_POINTER = re.compile(
    r"(?<![\w:])((?:const\s+|volatile\s+)*)\b(device|constant|threadgroup|thread)\s+"
    r"((?:const\s+|volatile\s+)*)(" + _TYPE + r")\s*([*&])"
)
_TG_ARRAY = re.compile(
    r"\bthreadgroup\s+(" + _TYPE + r")\s+(\w+)\s*\[([^\]]+)\]\s*;"
)


class MetalSourceError(Exception):
    """The Metal source uses something the shim does not support."""


@dataclasses.dataclass
class Binding:
    kind: str  # buffer | threadgroup | attribute
    index: str  # slot number or Attr name
    name: str

    def cpp(self) -> str:
        if self.kind == "attribute":
            idx = f"int(::metal_emu::Attr::{self.index})"
        else:
            idx = self.index
        return f'{{::metal_emu::Binding::{self.kind}, {idx}, "{self.name}"}}'


@dataclasses.dataclass
class Kernel:
    host_name: str
    function: str  # qualified name as instantiated
    template_args: str | None
    bindings: list[Binding]
    where: str


def preprocess(path: Path, include_dirs: list[Path], clang: str = "clang++") -> str:
    """Runs clang's preprocessor over a .metal file as Metal would see it."""
    cmd = [
        clang,
        "-E",
        "-x",
        "c++",
        "-std=c++17",
        "-nostdinc",
        "-nostdinc++",
        "-D__METAL_VERSION__=310",
        "-D__METAL__=1",
        f"-I{FAKE_INCLUDE}",
        f"-I{path.resolve().parent}",
    ]
    cmd += [f"-I{d}" for d in include_dirs]
    cmd.append(str(path))
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise MetalSourceError(f"preprocessing {path} failed:\n{res.stderr}")
    return res.stdout


def _split_params(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def _balanced(text: str, open_at: int) -> int:
    """Index just past the parenthesis matching the one at open_at."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise MetalSourceError("unbalanced parentheses in a kernel signature")


def _location(text: str, pos: int) -> str:
    """file:line of a position in preprocessed text, from its line markers."""
    line_no, fname, marker_end = 1, "?", 0
    for m in re.finditer(r"^# (\d+) \"([^\"]*)\".*$", text[:pos], re.M):
        line_no, fname, marker_end = int(m.group(1)), m.group(2), m.end() + 1
    line_no += text.count("\n", marker_end, pos)
    return f"{Path(fname).name}:{line_no}"


def _kernel_bindings(text: str) -> dict[str, tuple[list[Binding], str]]:
    kernels = {}
    for m in _KERNEL.finditer(text):
        name = m.group(1)
        end = _balanced(text, m.end() - 1)
        params = text[m.end() : end - 1]
        where = _location(text, m.start())
        binds = []
        for p in _split_params(params):
            attrs = _PARAM_ATTR.findall(p)
            ids = re.findall(r"\w+", _PARAM_ATTR.sub("", p))
            pname = ids[-1] if ids else "?"
            if len(attrs) != 1:
                raise MetalSourceError(
                    f"{where}: kernel {name}: parameter '{p.strip()}' needs "
                    "exactly one binding attribute"
                )
            attr, idx = attrs[0]
            if attr == "buffer":
                binds.append(Binding("buffer", idx, pname))
            elif attr == "threadgroup":
                binds.append(Binding("threadgroup", idx, pname))
            elif attr in ATTRIBUTES:
                binds.append(Binding("attribute", attr, pname))
            else:
                raise MetalSourceError(
                    f"{where}: kernel {name}: attribute [[{attr}]] of "
                    f"'{pname}' is not supported by the emulator"
                )
        if name in kernels:
            raise MetalSourceError(f"{where}: kernel {name} defined twice")
        kernels[name] = (binds, where)
    return kernels


def _rewrite_code(line: str, where) -> str:
    def tg_array(m: re.Match) -> str:
        ty, name, n = m.group(1).strip(), m.group(2), m.group(3)
        return (
            f"static ::metal_emu::tg_decl<{ty}, {n}> {name}__memu_decl"
            f'("{name}"); ::metal_emu::tg_array<{ty}, {n}> {name} = '
            f"{name}__memu_decl.get();"
        )

    def pointer(m: re.Match) -> str:
        lead, space, inner, ty, kind = m.groups()
        # volatile (atomics' signatures) has no meaning in the emulator.
        const = "const " if "const" in (lead + inner) else ""
        ty = ty.strip()
        if space == "thread":
            return f"{const}{ty}{kind}"
        if kind == "&":
            if space == "constant":
                return f"::metal_emu::cref<{ty}>"
            return f"{const}{ty}&"
        if space == "device":
            return f"::metal_emu::device_ptr<{const}{ty}>"
        if space == "constant":
            return f"::metal_emu::constant_ptr<{ty}>"
        return f"::metal_emu::tg_ptr<{const}{ty}>"

    line = _TG_ARRAY.sub(tg_array, line)
    line = _POINTER.sub(pointer, line)
    line = re.sub(r"\bconstant\s+constexpr\b", "constexpr", line)
    line = re.sub(r"\bconstant\b", "constexpr", line)
    line = re.sub(r"\bthread\b", "", line)
    bad = re.search(r"\b(device|threadgroup)\b", line)
    if bad:
        raise MetalSourceError(
            f"{where()}: unsupported use of the '{bad.group(1)}' address "
            f"space: {line.strip()}"
        )
    return line


def translate(path: Path, include_dirs: list[Path], prefix: str = "") -> tuple[str, list[Kernel]]:
    """C++ source for one .metal file, and the kernels it registers.

    Args:
        path: the .metal file.
        include_dirs: extra include directories (metal/).
        prefix: prepended to every host name (keeps fixtures apart).
    """
    text = preprocess(path, include_dirs)
    kernel_defs = _kernel_bindings(text)

    kernels: list[Kernel] = []

    def instantiation(m: re.Match) -> str:
        host = "".join(re.findall(r"\"([^\"]*)\"", m.group(1)))
        func, targs = m.group(4), m.group(5)
        short = func.split("::")[-1]
        if short not in kernel_defs:
            raise MetalSourceError(
                f"{_location(text, m.start())}: instantiation '{host}' of "
                f"{func}: no [[kernel]] template of that name"
            )
        binds, where = kernel_defs[short]
        kernels.append(Kernel(prefix + host, func, targs, binds, where))
        return f"template decltype({m.group(2)}<{m.group(3)}>) {func}<{targs}>;"

    text = _INSTANTIATION.sub(instantiation, text)
    # Non-template kernels register under their own name.
    for m in re.finditer(r"(?<!>)\s\[\[\s*kernel\s*\]\]\s*void\s+(\w+)", text):
        before = text[max(0, m.start() - 200) : m.start()]
        if re.search(r"template\s*<[^;{}]*>\s*$", before):
            continue
        binds, where = kernel_defs[m.group(1)]
        kernels.append(Kernel(prefix + m.group(1), m.group(1), None, binds, where))
    text = _STRIP_ATTRS.sub("", text)
    if "[[" in re.sub(r"\[\[\s*(clang::|gnu::|maybe_unused|fallthrough|nodiscard)", "", text):
        pos = text.index("[[")
        raise MetalSourceError(
            f"{_location(text, pos)}: unsupported attribute "
            f"{text[pos:pos + 40].splitlines()[0]}"
        )

    out_lines = []
    lines = text.split("\n")
    offset = 0
    for line in lines:
        if line.startswith("#"):
            out_lines.append(line)
        else:
            pos = offset
            out_lines.append(_rewrite_code(line, lambda: _location(text, pos + 1)))
        offset += len(line) + 1

    tu = re.sub(r"\W", "_", prefix + path.stem)
    regs = []
    for i, k in enumerate(kernels):
        fn = f"&{k.function}"
        if k.template_args is not None:
            fn += f"<{k.template_args}>"
        binds = ", ".join(b.cpp() for b in k.bindings)
        regs.append(
            f'static ::metal_emu::Registrar memu_reg_{i}("{k.host_name}", '
            f'"{k.where}", {fn}, {{{binds}}});'
        )
    cpp = "\n".join(
        [
            '#include "emu_registry.h"',
            f"namespace memu_tu_{tu} {{",
            *out_lines,
            '# 1 "<emulator registrations>"',
            *regs,
            f"}} // namespace memu_tu_{tu}",
            "",
        ]
    )
    return cpp, kernels


def syntax_check(
    path: Path, include_dirs: list[Path], clang: str = "clang++"
) -> subprocess.CompletedProcess:
    """Translates a .metal file and compiles it with -fsyntax-only.

    Returns the compiler's result (returncode, stderr); a source the
    translator rejects gives returncode 1 with the reason in stderr.
    """
    try:
        cpp, _ = translate(path, include_dirs)
    except MetalSourceError as e:
        return subprocess.CompletedProcess([], 1, "", str(e))
    cmd = [
        clang,
        "-x",
        "c++",
        "-std=c++17",
        "-fsyntax-only",
        f"-I{SHIM_DIR}",
        "-Wno-unknown-attributes",
        "-",
    ]
    return subprocess.run(cmd, input=cpp, capture_output=True, text=True)


def main() -> None:
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("metal", nargs="+")
    ap.add_argument("-I", dest="include", action="append", default=[])
    ap.add_argument("--prefix", default="")
    ap.add_argument("-o", dest="out")
    ap.add_argument(
        "--check", action="store_true", help="compile each file with -fsyntax-only"
    )
    args = ap.parse_args()
    includes = [Path(d) for d in args.include]
    if args.check:
        failed = 0
        for m in args.metal:
            res = syntax_check(Path(m), includes)
            print(f"{m}: {'ok' if res.returncode == 0 else 'FAILED'}")
            sys.stderr.write(res.stderr)
            failed += res.returncode != 0
        sys.exit(1 if failed else 0)
    cpp, _ = translate(Path(args.metal[0]), includes, args.prefix)
    if args.out:
        Path(args.out).write_text(cpp)
    else:
        print(cpp)


if __name__ == "__main__":
    main()
