"""Average ranks and Spearman's correlation (analyzers.stats), hand-computed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analyzers.stats import ranks, spearman


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
