"""Running a kernel family's instruction-set variants in turn (the packed GEMMs' `set_*_isa`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

ISAS = ("avx512", "avx2", "generic")


def runnable(set_isa: Callable[[str], str], isa: str) -> bool:
    """Whether this CPU runs `isa` (the override is restored)."""
    try:
        set_isa(isa)
    except ValueError:
        return False
    set_isa("")
    return True


def isa_fixture(set_isa: Callable[[str], str], what: str, names: Sequence[str] = ISAS):
    """A fixture over "" (the CPU's own pick) and every name this CPU runs, restored afterwards."""

    @pytest.fixture(params=["", *names])
    def isa(request):
        if request.param and not runnable(set_isa, request.param):
            pytest.skip(f"this CPU cannot run the {request.param} {what}")
        set_isa(request.param)
        yield request.param
        set_isa("")

    return isa
