"""Metal check on Linux: every metal/*.metal compiles as C++ against the shim.

There is no Metal compiler here, so each kernel file is run through clang's
preprocessor, its address spaces and attributes are mapped onto
tests/tools/metal_shim/metal_shim.h, and clang++ compiles the result: syntax and
type errors in the Metal source fail this test. The eval_gpu glue of
csrc/metal/ is compiled (and link-checked) against the macOS wheel's real
headers and dylib in test_macos_build.py, which also shim-compiles the
embedded kernel source of builds without the metallib.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from metal_shim import emulator
from metal_shim.metal2cpp import MetalSourceError, syntax_check, translate

METAL_FILES = sorted(emulator.METAL_DIR.glob("*.metal"))

pytestmark = pytest.mark.skipif(
    emulator.clang() is None,
    reason="clang++ not installed: the Metal shim check needs it "
    "(Debian: apt-get install clang)",
)


def test_metal_dir_has_kernels():
    assert METAL_FILES, "no metal/*.metal found"


@pytest.mark.parametrize("path", METAL_FILES, ids=[p.name for p in METAL_FILES])
def test_metal_file_compiles_against_the_shim(path: Path):
    res = syntax_check(path, [emulator.METAL_DIR])
    assert res.returncode == 0, f"{path.name} does not compile:\n{res.stderr}"


@pytest.mark.parametrize("path", METAL_FILES, ids=[p.name for p in METAL_FILES])
def test_metal_file_instantiates_named_kernels(path: Path):
    _, kernels = translate(path, [emulator.METAL_DIR])
    assert kernels, f"{path.name} instantiates no [[kernel]]"
    names = [k.host_name for k in kernels]
    assert len(set(names)) == len(names), f"duplicate host names in {path.name}"


BAD_SOURCES = {
    "write through a const device pointer": """
        [[kernel]] void k(const device float* x [[buffer(0)]],
                          uint i [[thread_position_in_grid]]) {
          x[i] = 1.0f;
        }
    """,
    "device pointer passed as a threadgroup pointer": """
        inline float first(threadgroup float* p) { return p[0]; }
        [[kernel]] void k(device float* x [[buffer(0)]],
                          uint i [[thread_position_in_grid]]) {
          x[i] = first(x);
        }
    """,
    "undeclared function": """
        [[kernel]] void k(device float* x [[buffer(0)]],
                          uint i [[thread_position_in_grid]]) {
          x[i] = simd_summ(x[i]);
        }
    """,
    "kernel parameter without a binding": """
        [[kernel]] void k(device float* x [[buffer(0)]], uint i) {
          x[i] = 0.0f;
        }
    """,
}


@pytest.mark.parametrize("what", list(BAD_SOURCES))
def test_shim_check_rejects_broken_metal(tmp_path: Path, what: str):
    src = tmp_path / "bad.metal"
    src.write_text("#include <metal_stdlib>\nusing namespace metal;\n")
    src.write_text(src.read_text() + textwrap.dedent(BAD_SOURCES[what]))
    res = syntax_check(src, [emulator.METAL_DIR])
    assert res.returncode != 0, f"the check accepted: {what}"
    assert "bad.metal" in res.stderr, "errors must point at the Metal file"


def test_translator_names_the_parameter_without_binding(tmp_path: Path):
    src = tmp_path / "k.metal"
    src.write_text(
        "[[kernel]] void k(device float* x [[buffer(0)]], uint tid) {}\n"
    )
    with pytest.raises(MetalSourceError, match="'uint tid'.*binding attribute"):
        translate(src, [])
