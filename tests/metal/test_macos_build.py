"""The macOS build, checked on Linux as far as it can be.

Link check: every ``csrc/metal/*.cpp`` is compiled as the macOS build
compiles it, against Apple's metal-cpp and MLX's macOS headers from the
pinned ``mlx-metal`` macOS wheel (a few system headers shimmed, declarations
only: ``tests/tools/metal_shim/apple_sdk/``), and every MLX / metal-cpp symbol the
object leaves undefined must be exported by that wheel's ``libmlx.dylib``.
The tests skip, saying why, when the wheel is not in its cache folder
(``python3 tests/tools/metal_shim/macos_wheel.py --fetch`` puts it there; CI does)
or a tool is missing.

Embedded source: a Mac without Xcode's metal compiler builds the extension
with the kernels embedded as one source string (``cmake/mtplx_metal.cmake``,
``cmake/embed_metal.py``). The string the CMake rule generates must equal, byte
for byte, the source that the shim compile and the threadgroup emulator run.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx
import pytest

from metal_shim import emulator
from metal_shim import macos_wheel as mw
from metal_shim.metal2cpp import syntax_check, translate

REPO = emulator.REPO
GLUE_FILES = sorted((REPO / "csrc" / "metal").glob("*.cpp"))
EMBED_DEFINE = "MTPLX_METAL_EMBEDDED"


def _glue_variants() -> list[tuple[str, Path, list[str]]]:
    # Files that switch on the embedded-source build are checked both ways.
    out = []
    for p in GLUE_FILES:
        out.append((p.name, p, []))
        if EMBED_DEFINE in p.read_text():
            out.append((f"{p.name}[embedded]", p, [f"-D{EMBED_DEFINE}=1"]))
    return out


GLUE_VARIANTS = _glue_variants()
needs_clang = pytest.mark.skipif(
    emulator.clang() is None,
    reason="clang++ not installed (Debian: apt-get install clang)",
)


@pytest.fixture(scope="session")
def mac_sdk(tmp_path_factory) -> mw.MacSdk:
    """The macOS wheel's headers and dylib, unpacked (skips without them)."""
    cxx = emulator.clang()
    if cxx is None:
        pytest.skip("clang++ not installed (Debian: apt-get install clang)")
    why = mw.libcxx_missing(cxx)
    if why:
        pytest.skip(f"clang++ cannot use libc++ ({why}); Debian: apt-get install libc++-dev libc++abi-dev")
    for name in ("llvm-nm", "llvm-cxxfilt"):
        if mw.tool(name) is None:
            pytest.skip(f"{name} not installed (Debian: apt-get install llvm)")
    wheel = mw.find_wheel()
    if wheel is None:
        pytest.skip(
            f"no mlx-metal=={mw.mlx_version()} macOS wheel in {mw.wheel_dir()}: "
            "python3 tests/tools/metal_shim/macos_wheel.py --fetch"
        )
    return mw.extract(wheel, tmp_path_factory.mktemp("macos-wheel"))


@pytest.fixture(scope="session")
def exports(mac_sdk) -> set[str]:
    return mw.exported_symbols(mac_sdk.dylib)


@pytest.fixture(scope="session")
def compile_glue(mac_sdk, tmp_path_factory):
    """run_compile(src, obj, defines): one glue compile for the macOS build,
    through a precompiled header of MLX's Metal headers."""
    pch = mw.precompile_mlx_metal(
        emulator.clang(), mac_sdk, tmp_path_factory.mktemp("pch") / "mlx_metal"
    )

    def run_compile(src: Path, obj: Path, defines: Sequence[str] = ()):
        cmd = mw.glue_compile_cmd(emulator.clang(), mac_sdk, src, obj, defines, pch)
        return subprocess.run(cmd, capture_output=True, text=True)

    return run_compile


@pytest.fixture(scope="session")
def glue_objects(compile_glue, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each glue variant compiled for the macOS build (two at a time)."""
    out_dir = tmp_path_factory.mktemp("glue")
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for i, (vid, src, defines) in enumerate(GLUE_VARIANTS):
            obj = out_dir / f"{i}_{src.stem}.o"
            jobs[vid] = (pool.submit(compile_glue, src, obj, defines), obj)
    return {vid: (f.result(), obj) for vid, (f, obj) in jobs.items()}


def test_csrc_metal_has_glue():
    assert GLUE_FILES, "no csrc/metal/*.cpp found"


def test_checked_macos_wheel_is_the_mlx_this_code_builds_against():
    # The wheel is chosen by the macOS pin; it must be the MLX installed here.
    assert mw.mlx_version() == importlib.metadata.version("mlx")


@pytest.mark.parametrize("vid", [v[0] for v in GLUE_VARIANTS])
def test_glue_compiles_against_apple_metal_cpp_and_mlx_macos_headers(glue_objects, vid):
    res, _ = glue_objects[vid]
    assert res.returncode == 0, f"{vid}:\n{res.stderr}"


@pytest.mark.parametrize("vid", [v[0] for v in GLUE_VARIANTS])
def test_glue_mlx_symbols_are_exported_by_macos_libmlx(glue_objects, exports, vid):
    res, obj = glue_objects[vid]
    assert res.returncode == 0, f"{vid} does not compile:\n{res.stderr}"
    needed = mw.undefined_symbols(obj)
    src = next(p for v, p, _ in GLUE_VARIANTS if v == vid)
    if "get_command_encoder(" in src.read_text():
        # That call is never inline: an empty list would mean a blind check.
        assert needed, f"{vid}: no MLX symbol found in the object"
    missing = sorted(needed[k] for k in needed.keys() - exports)
    assert not missing, (
        f"{vid} would not link on macOS; libmlx.dylib does not export:\n  "
        + "\n  ".join(missing)
    )


def test_symbol_names_unify_int64_spellings_only():
    # int64_t: 'long' on Linux, 'long long' on macOS; nothing else merges.
    linux = "mlx::core::metal::CommandEncoder::set_input_array(mlx::core::array const&, int, long)"
    mac = linux.replace(", long)", ", long long)")
    assert mw.canonical(linux) == mw.canonical(mac)
    assert mw.canonical(linux.replace(", long)", ", int)")) != mw.canonical(mac)
    assert mw.top_namespace("_ZN3mlx4core5metal6deviceENS0_6DeviceE") == "mlx"
    assert mw.top_namespace("_ZTVN3mlx4core9PrimitiveE") == "mlx"
    assert mw.top_namespace("_ZNSt3__16vectorIiNS_9allocatorIiEEED2Ev") is None


# Each case calls what the glue must not; all sit in one object (one compile)
# beside a correct call, and each must be reported on its own.
BROKEN_GLUE = {
    # Declared by MLX's header, but not exported (no MLX_API).
    "a function MLX does not export": (
        "mlx::core::metal::get_command_encoders().size();",
        "mlx::core::metal::get_command_encoders()",
    ),
    # As if written against another MLX: an overload the dylib lacks.
    "a wrong signature": (
        "mlx::core::metal::get_command_encoder(0);",
        "mlx::core::metal::get_command_encoder(int)",
    ),
    "a function that does not exist": (
        "mlx::core::metal::synchronize_all();",
        "mlx::core::metal::synchronize_all()",
    ),
}
_GLUE_TEMPLATE = """\
#include "metal/device.h"
namespace mlx::core::metal {{
MLX_API CommandEncoder& get_command_encoder(int index);
MLX_API void synchronize_all();
}}
void glue(mlx::core::Stream s) {{
  mlx::core::metal::device(s.device);  // the correct call
  {calls}
}}
"""


@pytest.fixture(scope="module")
def broken_glue(compile_glue, exports, tmp_path_factory) -> tuple[dict[str, str], set[str]]:
    """(needed, missing) demangled names of the broken glue's object."""
    d = tmp_path_factory.mktemp("broken_glue")
    src = d / "glue.cpp"
    src.write_text(_GLUE_TEMPLATE.format(calls="\n  ".join(c for c, _ in BROKEN_GLUE.values())))
    res = compile_glue(src, d / "glue.o")
    assert res.returncode == 0, f"the fixture itself must compile:\n{res.stderr}"
    needed = mw.undefined_symbols(d / "glue.o")
    return needed, {needed[k] for k in needed.keys() - exports}


@pytest.mark.parametrize("what", list(BROKEN_GLUE))
def test_link_check_rejects_glue_calling(broken_glue, what):
    _, missing = broken_glue
    symbol = BROKEN_GLUE[what][1]
    assert symbol in missing, f"not caught: {what}; missing={sorted(missing)}"


def test_link_check_accepts_the_correct_call_beside_them(broken_glue):
    needed, missing = broken_glue
    call = "mlx::core::metal::device(mlx::core::Device)"
    assert call in needed.values() and call not in missing
    assert len(missing) == len(BROKEN_GLUE), sorted(missing)


def test_glue_check_rejects_a_wrong_encoder_call(compile_glue, tmp_path):
    src = tmp_path / "bad_glue.cpp"
    src.write_text(
        '#include "metal/device.h"\n'
        "void f(mlx::core::Stream s) {\n"
        "  auto& enc = mlx::core::metal::get_command_encoder(s);\n"
        "  enc.dispatch_threadgroup(MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));\n"
        "}\n"
    )
    res = compile_glue(src, tmp_path / "bad.o")
    assert res.returncode != 0 and "dispatch_threadgroup" in res.stderr


# ---------------------------------------------------------------------------
# Embedded kernel source (macOS builds without Xcode's metal compiler)


def _cmake() -> str | None:
    return shutil.which("cmake")


def _cmake_script(tmp_path: Path, body: str, env: dict | None = None):
    script = tmp_path / "check.cmake"
    script.write_text(f'include("{REPO / "cmake" / "mtplx_metal.cmake"}")\n{body}')
    return subprocess.run(
        [_cmake(), "-P", str(script)], capture_output=True, text=True, env=env
    )


def _fake_xcrun(folder: Path, rc: int) -> dict:
    folder.mkdir()
    xcrun = folder / "xcrun"
    xcrun.write_text(f"#!/bin/sh\necho 'xcrun: fake' >&2\nexit {rc}\n")
    xcrun.chmod(xcrun.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.skipif(_cmake() is None, reason="cmake not installed")
@pytest.mark.parametrize(
    "xcrun_rc, expect",
    [(None, "EMBED"), (72, "EMBED"), (0, "METALLIB")],
    ids=["no xcrun", "xcrun without metal", "metal compiler present"],
)
def test_auto_mode_embeds_the_source_only_without_a_metal_compiler(tmp_path, xcrun_rc, expect):
    if xcrun_rc is None and shutil.which("xcrun"):
        pytest.skip("this machine has a real xcrun")
    env = None if xcrun_rc is None else _fake_xcrun(tmp_path / "bin", xcrun_rc)
    res = _cmake_script(
        tmp_path, 'mtplx_metal_mode(m AUTO)\nmessage(STATUS "mode=${m}")\n', env
    )
    assert res.returncode == 0, res.stderr
    assert f"mode={expect}" in res.stdout


@pytest.mark.skipif(_cmake() is None, reason="cmake not installed")
def test_unknown_kernel_mode_is_an_error_naming_the_option(tmp_path):
    res = _cmake_script(tmp_path, "mtplx_metal_mode(m METAL)\n")
    assert res.returncode != 0 and "MTPLX_METAL_KERNELS" in res.stderr


def _configure(root: Path, lists: str, *extra: str) -> tuple[Path, str]:
    """Configures a CMake project; returns its build folder and output."""
    (root / "CMakeLists.txt").write_text(textwrap.dedent(lists))
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = root / "build"
    cmd = [_cmake(), "-S", str(root), "-B", str(build), *gen, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return build, res.stdout


def _metal_dirs() -> str:
    # The include directories CMakeLists.txt passes: metal/ and MLX's.
    return f'"{REPO / "metal"}" "{Path(mlx.__path__[0]) / "include"}"'


@pytest.fixture(scope="module")
def cmake_embedded_source(tmp_path_factory) -> bytes:
    """The kernel string a macOS EMBED build compiles in, read back.

    A small CMake project hands a program to the build's own rule
    (mtplx_metal_kernels in EMBED mode, as CMakeLists.txt calls it for the
    extension), builds it and runs it: it prints the embedded string.
    """
    cxx = emulator.clang()
    if _cmake() is None or cxx is None:
        pytest.skip("cmake and clang++ are needed")
    root = tmp_path_factory.mktemp("embed")
    (root / "main.cpp").write_text(
        "#include <cstdio>\n"
        '#include "metal/embedded_source.h"\n'
        "#ifndef MTPLX_METAL_EMBEDDED\n"
        "#error the glue would load a metallib\n"
        "#endif\n"
        "int main() {\n"
        "  auto s = mtplx::metal::embedded_source();\n"
        "  std::fwrite(s.data(), 1, s.size(), stdout);\n"
        "}\n"
    )
    build, _ = _configure(
        root,
        f"""\
        cmake_minimum_required(VERSION 3.24)
        project(embed_check CXX)
        set(CMAKE_CXX_STANDARD 17)
        include("{REPO / 'cmake' / 'mtplx_metal.cmake'}")
        add_executable(print_source main.cpp)
        target_include_directories(print_source PRIVATE "{REPO / 'csrc'}")
        mtplx_metal_kernels(print_source MODE EMBED METAL_DIR "{REPO / 'metal'}"
                            INCLUDE_DIRS {_metal_dirs()})
        """,
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DCMAKE_CXX_COMPILER={cxx}",
    )
    res = subprocess.run([_cmake(), "--build", str(build)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    exe = build / "print_source"
    return subprocess.run([str(exe)], capture_output=True, check=True).stdout


@pytest.mark.skipif(_cmake() is None, reason="cmake not installed")
def test_metallib_mode_compiles_the_same_kernel_files(tmp_path):
    # mlx_build_metallib (MLX's, macOS only) replaced by one that reports
    # what it was given: the metal/*.metal files and the embed's includes.
    _, out = _configure(
        tmp_path,
        f"""\
        cmake_minimum_required(VERSION 3.24)
        project(metallib_check NONE)
        macro(mlx_build_metallib)
          cmake_parse_arguments(M "" "TARGET;TITLE;OUTPUT_DIRECTORY" "SOURCES;INCLUDE_DIRS;DEPS" ${{ARGN}})
          message(STATUS "metallib sources: ${{M_SOURCES}}")
          message(STATUS "metallib includes: ${{M_INCLUDE_DIRS}}")
          add_custom_target(${{M_TARGET}})
        endmacro()
        include("{REPO / 'cmake' / 'mtplx_metal.cmake'}")
        add_custom_target(ext)
        mtplx_metal_kernels(ext MODE METALLIB METAL_DIR "{REPO / 'metal'}"
                            INCLUDE_DIRS {_metal_dirs()})
        """,
    )
    sources = re.search(r"metallib sources: (.*)", out).group(1).split(";")
    includes = re.search(r"metallib includes: (.*)", out).group(1).split(";")
    assert sorted(sources) == [str(p) for p in sorted(emulator.METAL_DIR.glob("*.metal"))]
    assert includes == [str(REPO / "metal"), str(Path(mlx.__path__[0]) / "include")]


def test_cmake_embedded_source_is_what_the_emulator_runs(cmake_embedded_source):
    assert cmake_embedded_source == emulator.embedded_source().encode()


@needs_clang
def test_embedded_source_compiles_alone_against_the_shim(tmp_path, cmake_embedded_source):
    path = tmp_path / "embedded.metal"
    path.write_bytes(cmake_embedded_source)
    res = syntax_check(path, [])  # no include directory: self-contained
    assert res.returncode == 0, res.stderr


@needs_clang
def test_embedded_source_holds_every_kernel_of_metal_dir(tmp_path, cmake_embedded_source):
    path = tmp_path / "embedded.metal"
    path.write_bytes(cmake_embedded_source)
    embedded = sorted(k.host_name for k in translate(path, [])[1])
    separate = sorted(
        k.host_name
        for f in sorted(emulator.METAL_DIR.glob("*.metal"))
        for k in translate(f, [emulator.METAL_DIR])[1]
    )
    assert embedded == separate


def _embed(tmp_path: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    embed = emulator.embed_module()
    return embed.flatten(embed.metal_sources(tmp_path), [tmp_path])


def _preprocessed(tmp_path: Path, source: str) -> str:
    path = tmp_path / "flat.metal"
    path.write_text(source)
    res = subprocess.run(
        [emulator.clang(), "-E", "-P", "-x", "c++", "-nostdinc", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


@needs_clang
def test_flattening_keeps_pragma_once_semantics(tmp_path):
    # A header first included inside a disabled branch must still appear
    # (once) where it is included for real; a header without pragma once
    # appears at every include.
    src = _embed(
        tmp_path,
        {
            "once.h": "#pragma once\nint once_marker();\n",
            "many.h": "int many_marker();\n",
            "a.metal": '#if 0\n#include "once.h"\n#endif\n#include "once.h"\n'
            '#include "once.h"\n#include "many.h"\n#include "many.h"\n',
            "b.metal": '#include "once.h"\n#include "many.h"\n',
        },
    )
    out = _preprocessed(tmp_path, src)
    assert out.count("once_marker") == 1
    assert out.count("many_marker") == 3


@needs_clang
def test_macros_of_one_kernel_file_do_not_reach_the_next(tmp_path):
    src = _embed(
        tmp_path,
        {
            "a.metal": "#define KERNEL_NAME alpha\nint KERNEL_NAME;\n",
            "b.metal": "int KERNEL_NAME;\n",
        },
    )
    out = _preprocessed(tmp_path, src)
    assert "int alpha;" in out and "int KERNEL_NAME;" in out


def test_flattening_rejects_a_missing_include_naming_file_and_line(tmp_path):
    embed = emulator.embed_module()
    with pytest.raises(embed.EmbedError, match=r"k\.metal:2: .*nope\.h"):
        _embed(tmp_path, {"k.metal": '// kernels\n#include "nope.h"\n'})


def test_flattening_rejects_non_ascii_naming_file_and_line(tmp_path):
    embed = emulator.embed_module()
    with pytest.raises(embed.EmbedError, match=r"k\.h:3: non-ASCII"):
        _embed(tmp_path, {"k.h": "#pragma once\n\n// x \u00d7 y\n", "k.metal": '#include "k.h"\n'})


def test_flattening_keeps_metal_system_headers_and_line_markers(tmp_path):
    src = _embed(tmp_path, {"h.h": "#pragma once\nint h();\n", "k.metal": '#include <metal_stdlib>\n#include "h.h"\nint k();\n'})
    assert "#include <metal_stdlib>" in src
    assert '#line 1 "h.h"' in src and '#line 3 "k.metal"' in src


def test_embedded_literal_refuses_a_source_containing_its_delimiter():
    embed = emulator.embed_module()
    with pytest.raises(embed.EmbedError, match="literal"):
        embed.cpp_source(f'// ){embed.DELIMITER}"\n')
