"""A precompiled header for the fused kernels MLX's CPU backend compiles during a test run.

MLX compiles each new fused kernel by running `g++` (found on PATH) on a
short source that includes `mlx/backend/cpu/compiled_preamble.h`: about
70,000 lines once preprocessed, parsed again for every kernel (half a second
each; a cold run of the suite builds about 500). This module builds that
header once per run as a GCC precompiled header, with the flags MLX passes,
and puts a `g++` first on PATH that adds the header's folder to the include
path and runs the real compiler. GCC uses a precompiled header only when it
was built with the same compiler and options, and otherwise ignores it
silently and reads the header: the kernels are the same code either way
(their machine code was compared), just compiled about four times faster.
The kernel cache itself stays cold: every kernel is still compiled.

`MTPLX_TEST_PCH=0` turns it off.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ENV = "MTPLX_TEST_PCH"
HEADER = Path("mlx") / "backend" / "cpu" / "compiled_preamble.h"


def _mlx_include() -> Path | None:
    import mlx

    for root in map(Path, mlx.__path__):
        if (root / "include" / HEADER).is_file():
            return root / "include"
    return None


def _mlx_flag_sets() -> list[list[str]]:
    """The options MLX's CPU JIT may compile with (mlx/backend/cpu/jit_compiler.cpp), header options only: it
    adds the AVX2 ones where its own build and the CPU have AVX2. A header is built for each; GCC picks the
    one that matches from the `.gch` folder."""
    base = ["-std=c++17", "-O3", "-Wall", "-fPIC"]
    try:
        cpu = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        cpu = []
    return [base] + ([base + ["-mavx2", "-mfma", "-mf16c"]] if "avx2" in cpu else [])


def install(work: Path) -> str | None:
    """Builds the header under `work` and puts the `g++` shim first on PATH (this process and its children).

    Returns a line for the report header, or None where it is off or cannot apply (no g++, no MLX headers).
    """
    if os.environ.get(ENV) == "0":
        return None
    real = shutil.which("g++")
    include = _mlx_include()
    if real is None or include is None or not Path("/proc/cpuinfo").exists():
        return None
    pch_dir = work / "pch"
    gch = pch_dir / HEADER.with_name(HEADER.name + ".gch")  # a folder: GCC tries each header in it
    gch.mkdir(parents=True, exist_ok=True)
    for i, flags in enumerate(_mlx_flag_sets()):
        built = subprocess.run([real, *flags, "-I", str(include), "-x", "c++-header", str(include / HEADER),
                                "-o", str(gch / f"{i}.gch")], capture_output=True)
        if built.returncode != 0:
            return None
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "g++"
    shim.write_text(f'#!/bin/sh\nexec "{real}" -I "{pch_dir}" "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return f"MLX kernels compile with a precompiled header ({ENV}=0: off)"
