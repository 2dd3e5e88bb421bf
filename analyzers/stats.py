"""Small statistics the analyzers share: rank correlation, p-values, multiple-testing correction.

numpy only (no SciPy dependency). Every function is pure and deterministic for a
given seed.

* :func:`spearman`: Spearman's rank correlation (average ranks for ties).
* :func:`normal_p_value`: two-sided p-value of a difference from its bootstrap
  standard error, ``2 * (1 - Phi(|delta| / se))``.
* :func:`permutation_p_value`: one-sided p-value of a statistic against the same
  statistic over random relabellings, ``(1 + #{perm >= observed}) / (1 + num)``.
* :func:`holm`: Holm-Bonferroni adjusted p-values (family-wise error control
  across the rows of one result table).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

__all__ = ["ranks", "spearman", "normal_p_value", "permutation_p_value", "holm"]


def ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x``, ties given their average rank."""
    x = np.asarray(x, dtype=float)
    r = np.empty(x.size)
    if x.size == 0:
        return r
    order = np.argsort(x)  # one sort, ties neighbours in it (any order among them: they share their average rank)
    xs = x[order]
    starts_group = np.empty(x.size, dtype=bool)
    starts_group[0] = True
    starts_group[1:] = (xs[1:] != xs[:-1]) & ~(np.isnan(xs[1:]) & np.isnan(xs[:-1]))  # NaNs tie with each other
    first = np.flatnonzero(starts_group)  # 0-based position of each group of equal values
    last = np.r_[first[1:], x.size] - 1
    r[order] = ((first + last) / 2 + 1)[np.cumsum(starts_group) - 1]  # the group's average 1-based rank
    return r


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation of two equal-length samples; NaN with < 3 points or a constant sample."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < 3 or x.size != y.size:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    if np.std(rx) == 0 or np.std(ry) == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def normal_p_value(delta: float, se: float) -> float:
    """Two-sided p-value of ``delta`` given its standard error (normal approximation).

    1.0 for a zero difference; 0.0 for a non-zero difference with zero error; NaN when unknown.
    """
    if not (math.isfinite(delta) and math.isfinite(se)):
        return math.nan
    if delta == 0:
        return 1.0
    if se <= 0:
        return 0.0
    return float(math.erfc(abs(delta) / se / math.sqrt(2.0)))


def permutation_p_value(statistic: Callable[[np.ndarray], float], labels: np.ndarray, *, num: int,
                        rng: np.random.Generator) -> float:
    """One-sided permutation p-value: how often shuffled ``labels`` give a statistic >= the observed one.

    ``statistic(labels)`` is the observed value; ``num`` random permutations of
    ``labels`` form the null distribution. NaN when the observed statistic is NaN.
    """
    observed = statistic(labels)
    if not math.isfinite(observed):
        return math.nan
    at_least = 0
    for _ in range(num):
        value = statistic(rng.permutation(labels))
        if math.isfinite(value) and value >= observed - 1e-12:
            at_least += 1
    return (1 + at_least) / (1 + num)


def holm(p: np.ndarray) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (NaN stays NaN and does not count as a test)."""
    p = np.asarray(p, dtype=float)
    out = np.full(p.size, math.nan)
    idx = np.flatnonzero(np.isfinite(p))
    if not idx.size:
        return out
    order = idx[np.argsort(p[idx], kind="stable")]
    m = order.size
    adjusted = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out[order] = np.minimum(adjusted, 1.0)
    return out
