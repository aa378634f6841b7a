"""The old name of `mtplx_ext.decode`, kept importable: `import mtplx_ext.engine.constraint` and the like still work.

The package was renamed so that each folder says its job (`decode/`: the
cycle and fixed-batch generation; `batching/`: the continuous-batching
`Engine`). Importing it warns (DeprecationWarning); each old submodule name
is the new module itself, so classes and state are shared.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

import mtplx_ext.decode as decode
from mtplx_ext.decode import *  # noqa: F401,F403
from mtplx_ext.decode import __all__  # noqa: F401

warnings.warn("mtplx_ext.engine is now mtplx_ext.decode", DeprecationWarning, stacklevel=2)

for info in pkgutil.iter_modules(decode.__path__):
    sys.modules[f"{__name__}.{info.name}"] = importlib.import_module(f"{decode.__name__}.{info.name}")
