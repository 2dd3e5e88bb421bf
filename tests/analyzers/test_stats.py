"""Average ranks and Spearman's correlation (analyzers.stats), hand-computed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analyzers.stats import min_detectable_effect, normal_quantile, ranks, runs_needed, spearman, t_p_value, t_quantile


@pytest.mark.parametrize(("x", "expected"), [
    ([], []),
    ([7.0], [1.0]),
    ([30.0, 10.0, 20.0], [3.0, 1.0, 2.0]),
    ([2.0, 1.0, 2.0, 3.0], [2.5, 1.0, 2.5, 4.0]),  # the tied 2s share ranks 2 and 3
    ([5.0, 5.0, 5.0], [2.0, 2.0, 2.0]),
    ([1.0, math.nan, 0.0, math.nan], [2.0, 3.5, 1.0, 3.5]),  # NaNs sort last and tie with each other
])
def test_ranks_average_ties(x, expected):
    assert ranks(np.array(x)).tolist() == expected


def test_spearman_of_a_monotone_and_a_reversed_sample():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x ** 3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert math.isnan(spearman(x, np.ones(4)))


# Student's t, the normal quantile and what a comparison of so many runs can detect (analyzers.compare), checked
# against printed tables (Student's t: two-sided 5% critical values; the normal's 97.5% point).
@pytest.mark.parametrize(("p", "df", "expected"), [
    (0.975, 1, 12.7062), (0.975, 4, 2.7764), (0.975, 10, 2.2281), (0.9, 4, 1.5332), (0.995, 30, 2.7500),
    (0.975, math.inf, 1.95996), (0.025, 4, -2.7764),
])
def test_t_quantiles_match_the_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(("t", "df", "expected"), [(2.7764, 4, 0.05), (2.2281, 10, 0.05), (0.0, 3, 1.0),
                                                   (1.95996, math.inf, 0.05)])
def test_t_p_values_are_two_sided(t, df, expected):
    assert t_p_value(t, df) == pytest.approx(expected, abs=1e-4)
    assert t_p_value(-t, df) == pytest.approx(t_p_value(t, df))
    assert math.isnan(t_p_value(math.nan, df))


def test_normal_quantile_inverts_the_normal():
    assert normal_quantile(0.5) == pytest.approx(0.0, abs=1e-9)
    assert normal_quantile(0.9) == pytest.approx(1.28155, abs=1e-4)
    with pytest.raises(ValueError):
        normal_quantile(1.0)


def test_minimum_detectable_effect_by_hand():
    # one run a side, known sigma 0.3: (1.95996 + 1.28155) * 0.3 * sqrt(2) = 1.3753
    assert min_detectable_effect(0.3, 1, 1, alpha=0.05, power=0.9) == pytest.approx(1.3753, abs=1e-3)
    # three a side, 4 degrees of freedom: (2.7764 + 1.5332) * 0.3 * sqrt(2/3) = 1.0557
    assert min_detectable_effect(0.3, 3, 3, alpha=0.05, power=0.9, df=4) == pytest.approx(1.0557, abs=1e-3)
    assert math.isnan(min_detectable_effect(0.3, 0, 3, alpha=0.05, power=0.9))


def test_runs_needed_is_the_first_size_that_detects_the_effect():
    n = runs_needed(0.2, 0.25, alpha=0.05, power=0.9)
    assert min_detectable_effect(0.25, n, n, alpha=0.05, power=0.9, df=2 * n - 2) <= 0.2
    assert min_detectable_effect(0.25, n - 1, n - 1, alpha=0.05, power=0.9, df=2 * n - 4) > 0.2
    assert runs_needed(-0.2, 0.25, alpha=0.05, power=0.9) == n  # the size of a change, either way
    assert runs_needed(1e-4, 0.5, alpha=0.05, power=0.9) is None  # beyond 1000 runs a side
    assert runs_needed(0.0, 0.5, alpha=0.05, power=0.9) is None and runs_needed(0.1, 0.0, alpha=0.05, power=0.9) == 2
