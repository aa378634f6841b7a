"""Flattens metal/*.metal into one self-contained Metal source and embeds it.

A Mac without Xcode's ``metal`` tool cannot build ``mtplx_ext.metallib``; the
extension then carries its kernels as source and has MLX's device compile them
at first use (``metal::Device::get_library(name, builder)``). Metal's runtime
compiler resolves no include of ours, so every ``#include`` that names a file
under an include directory is inlined, in place. ``#pragma once`` becomes an
include guard (the preprocessor then keeps exactly the copies it would keep),
and a kernel file's own macros are undefined after it, as at the end of its
translation unit; the shim compile and the emulator run the merged source, so
a clash between files shows up on Linux. ``#line`` markers keep compiler
messages pointing at the original files. Includes found nowhere
(``<metal_stdlib>``, ``<cstdint>`` of host-only branches) stay as they are.

The macOS build runs this through ``cmake/mtplx_metal.cmake``; the test suite
runs the same function and executes its output in the threadgroup emulator.

    python3 cmake/embed_metal.py --metal-dir metal -I metal \\
        --out-cpp build/mtplx_metal_embedded.cpp [--out-metal all.metal]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

#: Raw string delimiter of the generated C++ literal (at most 16 characters).
DELIMITER = "mtplx_metal"

_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\b")
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.M)


class EmbedError(Exception):
    """A kernel source cannot be embedded (missing include, non-ASCII, ...)."""


def _guard(label: str) -> str:
    return "MTPLX_EMBEDDED_" + re.sub(r"\W", "_", label)


def _resolve(name: str, quoted: bool, includer: Path, include_dirs: list[Path]) -> Path | None:
    dirs = ([includer.parent] if quoted else []) + include_dirs
    for d in dirs:
        cand = d / name
        if cand.is_file():
            return cand.resolve()
    return None


def _inline(
    path: Path,
    label: str,
    include_dirs: list[Path],
    stack: list[Path],
    labels: dict[str, Path],
    out: list[str],
) -> None:
    if labels.setdefault(label, path) != path:
        # Same guard for two files would drop one of them.
        raise EmbedError(f"{label}: two different files have this name")
    text = path.read_bytes()
    try:
        src = text.decode("ascii")
    except UnicodeDecodeError as e:
        line = text[: e.start].count(b"\n") + 1
        raise EmbedError(
            f"{label}:{line}: non-ASCII byte; MLX hands kernel source to "
            "Metal as ASCII"
        ) from None
    lines = src.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    once = any(_PRAGMA_ONCE.match(line) for line in lines)
    guard = _guard(label)
    if once:
        out += [f"#ifndef {guard}", f"#define {guard}"]
    out.append(f'#line 1 "{label}"')
    for no, line in enumerate(lines, start=1):
        if _PRAGMA_ONCE.match(line):
            out.append("")  # keeps the line numbering
            continue
        m = _INCLUDE.match(line)
        target = m and _resolve(m.group(2), m.group(1) == '"', path, include_dirs)
        if not m or (target is None and m.group(1) == "<"):
            out.append(line)  # code, or a header of the Metal compiler itself
            continue
        if target is None:
            raise EmbedError(
                f'{label}:{no}: #include "{m.group(2)}" found in no include '
                "directory"
            )
        if target in stack:
            if _has_pragma_once(target):
                out.append("")  # already being included: pragma once skips it
                continue
            raise EmbedError(f"{label}:{no}: {m.group(2)} includes itself")
        _inline(
            target, _label(target, include_dirs), include_dirs, stack + [target], labels, out
        )
        out.append(f'#line {no + 1} "{label}"')
    if once:
        out.append(f"#endif // {guard}")


def _has_pragma_once(path: Path) -> bool:
    text = path.read_text(errors="replace")
    return any(_PRAGMA_ONCE.match(line) for line in text.splitlines())


def _label(path: Path, include_dirs: list[Path]) -> str:
    for d in include_dirs:
        try:
            return str(path.relative_to(d.resolve()))
        except ValueError:
            continue
    return path.name


def metal_sources(metal_dir: Path) -> list[Path]:
    """The kernel files that the metallib build compiles: metal_dir/*.metal."""
    return sorted(Path(metal_dir).glob("*.metal"))


def flatten(metal_files: list[Path], include_dirs: list[Path]) -> str:
    """One self-contained Metal source holding every kernel file.

    Args:
        metal_files: the ``.metal`` files, in order.
        include_dirs: directories searched for includes (after the
            including file's own directory for quoted ones).

    Returns:
        The source, ending in a newline.

    Raises:
        EmbedError: an include that is found nowhere, a cycle, a non-ASCII
            byte, or no kernel file at all.
    """
    if not metal_files:
        raise EmbedError("no .metal kernel files to embed")
    dirs = [Path(d).resolve() for d in include_dirs]
    out = ["// mtplx_ext Metal kernels, flattened by cmake/embed_metal.py."]
    labels: dict[str, Path] = {}
    for f in metal_files:
        f = Path(f).resolve()
        _inline(f, _label(f, dirs), dirs, [f], labels, out)
        # Macros of one kernel file end with it, as in its own translation
        # unit (those of its headers stay: their guards skip a second copy).
        out += [f"#undef {m}" for m in dict.fromkeys(_DEFINE.findall(f.read_text()))]
    return "\n".join(out) + "\n"


def cpp_source(metal_source: str) -> str:
    """C++ translation unit defining mtplx::metal::embedded_source()."""
    end = f'){DELIMITER}"'
    if end in metal_source:
        raise EmbedError(f"the kernel source contains {end!r}, the literal's end")
    return (
        "// Generated by cmake/embed_metal.py from metal/: do not edit.\n"
        '#include "metal/embedded_source.h"\n\n'
        "namespace mtplx::metal {\n\n"
        "std::string_view embedded_source() {\n"
        f'  static constexpr char kSource[] = R"{DELIMITER}({metal_source}){DELIMITER}";\n'
        "  return {kSource, sizeof(kSource) - 1};\n"
        "}\n\n"
        "} // namespace mtplx::metal\n"
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metal-dir", required=True, type=Path)
    ap.add_argument("-I", dest="include", action="append", default=[], type=Path)
    ap.add_argument("--out-cpp", type=Path)
    ap.add_argument("--out-metal", type=Path)
    args = ap.parse_args(argv)
    try:
        src = flatten(metal_sources(args.metal_dir), args.include)
        cpp = cpp_source(src)
    except EmbedError as e:
        print(f"embed_metal: {e}", file=sys.stderr)
        return 1
    if args.out_metal:
        _write(args.out_metal, src)
    if args.out_cpp:
        _write(args.out_cpp, cpp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
