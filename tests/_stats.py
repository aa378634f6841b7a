"""Goodness-of-fit helper shared by the statistical tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chi2

#: An exact sampler must pass each G-test at this level. The suite runs some
#: 25 of them, so at 1e-3 one would fail about once in 40 runs by chance
#: (seen once in CI: p = 4.7e-4); at 1e-5 about once in 4000.
ALPHA_EXACT = 1e-5
#: A deliberately broken variant must be rejected at this level (on the same
#: sample sizes its p-values are far smaller).
ALPHA_BROKEN = 1e-3


def g_test_pvalue(observed: np.ndarray, expected_p: np.ndarray) -> float:
    """G-test p-value; 0 when a cell of probability 0 was observed."""
    n = observed.sum()
    if np.any(observed[expected_p == 0] > 0):
        return 0.0
    e = expected_p[expected_p > 0] * n
    o = observed[expected_p > 0].astype(np.float64)
    # Pool sparse cells so that the chi-square approximation holds.
    small = e < 5
    if small.any():
        e = np.append(e[~small], e[small].sum())
        o = np.append(o[~small], o[small].sum())
    if len(e) < 2:
        # One possible outcome, and every draw fell in it (checked above).
        return 1.0
    nz = o > 0
    g = 2.0 * np.sum(o[nz] * np.log(o[nz] / e[nz]))
    return float(chi2.sf(g, df=len(e) - 1))
