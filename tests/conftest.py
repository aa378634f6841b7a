import mtplx_ext  # noqa: F401  (first: loads the fast BLAS before mlx.core)
import os
import sys

# Helpers shared by test modules (tests/_*.py) import as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
