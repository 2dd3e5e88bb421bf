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
* :func:`t_p_value`, :func:`t_quantile`, :func:`normal_quantile`: Student's t and the
  normal distribution (the run-level tests of :mod:`analyzers.noise`).
* :func:`min_detectable_effect`, :func:`runs_needed`: what a comparison of so many
  runs per side can detect at a given power, and how many runs a given effect needs.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np

__all__ = ["ranks", "spearman", "normal_p_value", "permutation_p_value", "holm", "normal_quantile", "t_p_value",
           "t_quantile", "min_detectable_effect", "runs_needed"]


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


def normal_quantile(p: float) -> float:
    """The standard normal's ``p`` quantile (bisection on ``erfc``)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    lo, hi = -40.0, 40.0
    for _ in range(200):  # bisection on erfc: monotone, exact to double precision in ~100 halvings
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1 - x) / b


def t_p_value(t: float, df: float) -> float:
    """Two-sided p-value of Student's ``t`` with ``df`` degrees of freedom (``df = inf``: the normal's)."""
    if not (math.isfinite(t) and df > 0):
        return math.nan
    if math.isinf(df):
        return float(math.erfc(abs(t) / math.sqrt(2.0)))
    return _incomplete_beta(df / 2, 0.5, df / (df + t * t))


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """Student's t ``p`` quantile with ``df`` degrees of freedom (bisection on :func:`t_p_value`; remembered)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    if math.isinf(df):
        return normal_quantile(p)
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_p_value(hi, df) / 2 > 1 - p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_p_value(mid, df) / 2 > 1 - p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10 * max(1.0, hi):
            break
    return (lo + hi) / 2


def min_detectable_effect(sigma: float, n_a: int, n_b: int, *, alpha: float, power: float,
                          df: float = math.inf) -> float:
    """The smallest difference of means a two-sided test at level ``alpha`` detects with probability ``power``,
    for samples of ``n_a`` and ``n_b`` with standard deviation ``sigma`` each:
    ``(t_{1-alpha/2} + t_{power}) * sigma * sqrt(1/n_a + 1/n_b)`` (``df``: the test's degrees of freedom)."""
    if n_a < 1 or n_b < 1 or not math.isfinite(sigma):
        return math.nan
    return (t_quantile(1 - alpha / 2, df) + t_quantile(power, df)) * sigma * math.sqrt(1 / n_a + 1 / n_b)


def runs_needed(effect: float, sigma: float, *, alpha: float, power: float, most: int = 1000) -> int | None:
    """Runs per side for :func:`min_detectable_effect` to reach ``effect`` (a pooled t-test over both sides'
    runs, ``2n - 2`` degrees of freedom); None when even ``most`` runs per side are not enough."""
    effect = abs(effect)
    if not (math.isfinite(effect) and math.isfinite(sigma)) or effect <= 0:
        return None
    if sigma <= 0:
        return 2

    def enough(n: int) -> bool:
        return min_detectable_effect(sigma, n, n, alpha=alpha, power=power, df=2 * n - 2) <= effect

    if not enough(most):
        return None
    lo, hi = 2, most  # the detectable effect shrinks as runs are added: the first n that is enough, by bisection
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid + 1, hi)
    return lo
