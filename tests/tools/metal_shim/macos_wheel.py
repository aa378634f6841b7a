"""MLX's macOS wheel on Linux: real Metal headers and the real libmlx.dylib.

The ``mlx-metal`` wheel of the pinned MLX version holds Apple's metal-cpp
(``mlx/include/metal_cpp``), MLX's macOS headers (``mlx/include/mlx``) and
``mlx/lib/libmlx.dylib`` (arm64 Mach-O). With them the eval_gpu glue of
``csrc/metal/`` is compiled here as on a Mac (clang, libc++, so that C++
names carry libc++'s ``std::__1``) and every MLX / metal-cpp symbol it leaves
undefined is looked up among the dylib's exports: a call that would not link
on a Mac fails on Linux.

The tests never download. ``python3 tests/tools/metal_shim/macos_wheel.py --fetch``
(run by ``.ci/run``) puts the wheel into the cache folder: ``$MTPLX_MACOS_WHEEL_DIR``,
by default ``build/macos-wheel/`` in the repository.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
#: Declarations-only stand-ins for the macOS system headers metal-cpp includes.
APPLE_SDK_SHIM = Path(__file__).resolve().parent / "apple_sdk"
WHEEL_DIR_ENV = "MTPLX_MACOS_WHEEL_DIR"
PLATFORM = "macosx_14_0_arm64"

#: Namespaces whose symbols the glue must find in libmlx.dylib: MLX's own and
#: metal-cpp's (MLX defines metal-cpp's selectors and classes).
LIBMLX_NAMESPACES = ("mlx", "MTL", "MTL4", "NS", "CA", "MTLFX")

# Itanium mangling of a name nested in a namespace, optionally a vtable,
# typeinfo, guard variable or local static of one: _ZN3mlx..., _ZTVN3mlx...
_NESTED = re.compile(r"_Z(?:T[VIST]|GV|TH|TW)?Z?N[rVKOR]*(\d+)")


def wheel_dir() -> Path:
    """The folder the macOS wheel is fetched into and looked up in."""
    env = os.environ.get(WHEEL_DIR_ENV)
    return Path(env) if env else REPO / "build" / "macos-wheel"


def mlx_version() -> str:
    """The MLX version macOS builds pin (pyproject.toml), without needing MLX.

    Raises:
        RuntimeError: no macOS pin, or pins that disagree.
    """
    text = (REPO / "pyproject.toml").read_text()
    pins = set(re.findall(r"\"mlx==([\w.]+);\s*sys_platform\s*==\s*'darwin'\"", text))
    if len(pins) != 1:
        raise RuntimeError(f"pyproject.toml: expected one macOS pin of mlx, found {sorted(pins)}")
    return pins.pop()


def find_wheel(version: str | None = None, folder: Path | None = None) -> Path | None:
    """The cached mlx-metal macOS arm64 wheel of `version` (default: the
    pinned one), or None."""
    version = version or mlx_version()
    folder = folder or wheel_dir()
    hits = sorted(folder.glob(f"mlx_metal-{version}-*-macosx_*_arm64.whl"))
    return hits[-1] if hits else None


def fetch(version: str | None = None, folder: Path | None = None) -> Path:
    """Downloads the mlx-metal macOS wheel into the cache folder (pip).

    Returns:
        The wheel's path (an existing one is reused).

    Raises:
        RuntimeError: pip could not get it.
    """
    version = version or mlx_version()
    folder = folder or wheel_dir()
    have = find_wheel(version, folder)
    if have:
        return have
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--platform", PLATFORM,
        f"mlx-metal=={version}", "-d", str(folder),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(version, folder)
    if res.returncode != 0 or wheel is None:
        raise RuntimeError(f"pip download mlx-metal=={version} failed:\n{res.stderr}")
    return wheel


@dataclasses.dataclass(frozen=True)
class MacSdk:
    """What the macOS build of the extension compiles and links against."""

    include_dirs: list[Path]  # metal-cpp and MLX's headers, as MLX's CMake target
    defines: list[str]  # MLX's public compile definitions (-D...)
    dylib: Path  # libmlx.dylib


def extract(wheel: Path, dest: Path) -> MacSdk:
    """Unpacks the headers, MLX's CMake config and libmlx.dylib of `wheel`."""
    with zipfile.ZipFile(wheel) as z:
        names = [
            n
            for n in z.namelist()
            if n.startswith(("mlx/include/", "mlx/share/cmake/MLX/"))
            or n == "mlx/lib/libmlx.dylib"
        ]
        z.extractall(dest, names)
    root = dest / "mlx"
    config = (root / "share" / "cmake" / "MLX" / "MLXConfig.cmake").read_text()
    # The flags MLXConfig.cmake adds for this build (Metal, Accelerate).
    defines = re.findall(
        r"if \(ON\)\s*\n(?:[^\n]*\n)*?\s*set\(MLX_CXX_FLAGS \$\{MLX_CXX_FLAGS\} (-D\w+)\)",
        config,
    )
    if "-D_METAL_" not in defines:
        raise RuntimeError(f"{wheel.name}: MLXConfig.cmake sets no -D_METAL_ (format changed?)")
    return MacSdk(
        include_dirs=[root / "include" / "metal_cpp", root / "include"],
        defines=defines,
        dylib=root / "lib" / "libmlx.dylib",
    )


def tool(name: str) -> str | None:
    """An LLVM tool (llvm-nm, llvm-cxxfilt), or None (Debian: apt-get install llvm)."""
    return shutil.which(name)


def libcxx_missing(cxx: str) -> str | None:
    """Why `cxx` cannot compile against libc++, or None when it can."""
    res = subprocess.run(
        [cxx, "-x", "c++", "-std=c++20", "-stdlib=libc++", "-fsyntax-only", "-"],
        input="#include <string>\n#include <functional>\n",
        capture_output=True,
        text=True,
    )
    return None if res.returncode == 0 else res.stderr.strip().splitlines()[0]


def compile_flags(sdk: MacSdk, defines: Sequence[str] = ()) -> list[str]:
    """clang++ flags that compile glue as the macOS build does (no -c/-o)."""
    return [
        "-std=c++20",
        "-stdlib=libc++",  # std::__1 names, as on macOS
        "-fblocks",  # metal-cpp's completion handlers (on by default on macOS)
        # -O0 emits every inline function used, so the calls inside MLX's and
        # metal-cpp's inline code are checked too.
        "-O0",
        "-w",
        *sdk.defines,
        "-DMTPLX_METAL=1",
        *defines,
        f"-I{APPLE_SDK_SHIM}",
        *(f"-I{d}" for d in sdk.include_dirs),
        f"-I{REPO / 'csrc'}",
        f"-I{REPO / 'metal'}",
    ]


def precompile_mlx_metal(cxx: str, sdk: MacSdk, out: Path) -> Path:
    """A precompiled header of MLX's Metal device header (what all glue
    includes), which halves each glue compile.

    Raises:
        RuntimeError: the header does not compile (the message says why).
    """
    header = out.with_suffix(".h")
    header.write_text('#include "mlx/backend/metal/device.h"\n')
    pch = out.with_suffix(".h.pch")
    cmd = [cxx, *compile_flags(sdk), "-x", "c++-header", str(header), "-o", str(pch)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"MLX's Metal headers do not compile:\n{res.stderr}")
    return pch


def glue_compile_cmd(
    cxx: str,
    sdk: MacSdk,
    src: Path,
    obj: Path,
    defines: Sequence[str] = (),
    pch: Path | None = None,
) -> list[str]:
    """clang++ command compiling one glue file to an object, as on macOS."""
    use_pch = ["-include-pch", str(pch)] if pch else []
    return [cxx, *compile_flags(sdk, defines), *use_pch, "-c", str(src), "-o", str(obj)]


def top_namespace(mangled: str) -> str | None:
    """Outermost namespace of an Itanium-mangled nested name, else None."""
    m = _NESTED.match(mangled)
    if not m:
        return None
    n = int(m.group(1))
    return mangled[m.end() : m.end() + n]


def canonical(demangled: str) -> str:
    """A demangled name with the type spellings that differ by target unified.

    int64_t is ``long`` on Linux and ``long long`` on macOS; MLX's float16_t
    is a struct on x86-64 and ``__fp16`` on Apple silicon. Both map to one
    spelling, so that the Linux-compiled glue's names compare with the
    dylib's.
    """
    name = demangled.replace("long long", "long")
    return name.replace("mlx::core::_MLX_Float16", "__fp16")


def _libmlx_names(nm_lines: list[str], strip_underscore: bool) -> list[str]:
    names = []
    for line in nm_lines:
        parts = line.split()
        if not parts:
            continue
        name = parts[-1]
        if strip_underscore and name.startswith("_"):
            name = name[1:]  # Mach-O prepends '_' to every C-level name
        if top_namespace(name) in LIBMLX_NAMESPACES:
            names.append(name)
    return names


def _demangle(names: list[str]) -> dict[str, str]:
    res = subprocess.run(
        [tool("llvm-cxxfilt")], input="\n".join(names) + "\n",
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(zip(names, res.stdout.splitlines()))


def _nm(args: list[str]) -> list[str]:
    res = subprocess.run(
        [tool("llvm-nm"), *args], capture_output=True, text=True, check=True
    )
    return res.stdout.splitlines()


def exported_symbols(dylib: Path) -> set[str]:
    """Canonical names of the MLX / metal-cpp symbols `dylib` exports."""
    names = _libmlx_names(_nm(["-gU", "--defined-only", str(dylib)]), True)
    return {canonical(d) for d in _demangle(names).values()}


def undefined_symbols(obj: Path) -> dict[str, str]:
    """The MLX / metal-cpp symbols `obj` needs: canonical -> demangled name."""
    names = _libmlx_names(_nm(["-u", str(obj)]), False)
    return {canonical(d): d for d in _demangle(names).values()}


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fetch", action="store_true", help="download the wheel if missing")
    args = ap.parse_args()
    wheel = fetch() if args.fetch else find_wheel()
    if wheel is None:
        print(f"no mlx-metal=={mlx_version()} macOS wheel in {wheel_dir()}")
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
