"""Goodness-of-fit helper shared by the statistical tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chi2


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
    nz = o > 0
    g = 2.0 * np.sum(o[nz] * np.log(o[nz] / e[nz]))
    return float(chi2.sf(g, df=len(e) - 1))
