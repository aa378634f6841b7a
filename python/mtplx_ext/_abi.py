"""Import-time check that the compiled core matches the installed MLX."""

from __future__ import annotations

import importlib.metadata


def _installed(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_extension() -> None:
    """Imports `_ext` and proves that mx.array arguments bind to it.

    Raises:
        ImportError: naming the MLX and nanobind versions the extension was
            built with and the MLX now installed, when they do not match.
    """
    import mlx.core as mx

    try:
        from mtplx_ext import _ext
    except ImportError as e:
        raise ImportError(
            f"mtplx_ext's compiled core failed to load ({e}); installed mlx is "
            f"{_installed('mlx')}. Reinstall mtplx-ext against this mlx."
        ) from e
    info = _ext.build_info()
    try:
        _ext.abi_probe(mx.zeros((1,)))
    except TypeError as e:
        raise ImportError(
            "mtplx_ext._ext cannot take mx.array arguments: it was built with "
            f"mlx {info['mlx_version']} and nanobind {info['nanobind_version']}, "
            f"but mlx {mx.__version__} is installed. The extension's nanobind "
            "must match the ABI of the nanobind that built the mlx wheel; "
            f"reinstall mtplx-ext. ({e})"
        ) from e
    if info["mlx_version"] != _installed("mlx"):
        raise ImportError(
            f"mtplx_ext._ext was built against mlx {info['mlx_version']} but "
            f"mlx {_installed('mlx')} is installed (nanobind "
            f"{info['nanobind_version']}); the C++ ABI must match exactly. "
            "Reinstall mtplx-ext."
        )
