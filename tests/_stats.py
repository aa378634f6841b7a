"""Goodness-of-fit helper shared by the statistical tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chi2, combine_pvalues

#: An exact sampler must pass each G-test at this level. The suite runs some
#: 25 of them: under a fixed run seed (CI) their outcome is fixed; under fresh
#: seeds about one run in 40 sees one fail by chance. Replay that run's seed
#: (`_seed`): the failing test's draws come back, and a few more fresh seeds
#: tell chance (p spread uniformly) from a bug (p small again).
ALPHA_EXACT = 1e-3
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


def pooled_pvalue(pvalues: list[float]) -> float:
    """Fisher's combination of independent tests' p-values: one test over all their data.

    A broken rule can be almost harmless on one random toy model and plain
    on another; pooling a few independent models is one test whose power
    does not hang on a single draw (unlike retrying until one rejects).
    """
    return float(combine_pvalues(np.maximum(pvalues, 1e-300), method="fisher").pvalue)
