"""Arrival processes: rates, burstiness, constant gaps, trace timestamps, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokentrace.app.bench.arrivals import Arrivals


def test_poisson_gaps_have_the_requested_mean_and_unit_cv():
    t = Arrivals("poisson", rate=50.0).offsets(20_000, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(burstiness):
    gaps = np.diff(Arrivals("gamma", rate=10.0, burstiness=burstiness).offsets(20_000, seed=2))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_constant_rate_is_exact():
    t = Arrivals("constant", rate=4.0).offsets(5)
    assert list(t) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_infinite_rate_sends_everything_at_once():
    assert list(Arrivals("poisson").offsets(3)) == [0.0, 0.0, 0.0]


def test_trace_offsets_start_at_zero_and_keep_the_gaps():
    t = Arrivals("trace").offsets(3, trace_offsets_s=[2.0, 2.5, 4.0, 9.0])
    assert list(t) == [0.0, 0.5, 2.0]


def test_same_seed_same_offsets_other_seed_other_offsets():
    a = Arrivals("poisson", rate=5.0)
    assert np.array_equal(a.offsets(10, seed=3), a.offsets(10, seed=3))
    assert not np.array_equal(a.offsets(10, seed=3), a.offsets(10, seed=4))


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "uniform"}, "unknown arrival"),
    ({"kind": "poisson", "rate": 0.0}, "rate"),
    ({"kind": "gamma", "rate": 1.0, "burstiness": 0.0}, "burstiness"),
    ({"kind": "constant"}, "finite"),
])
def test_bad_arrivals_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Arrivals(**kwargs)


def test_trace_kind_needs_timestamps():
    with pytest.raises(ValueError, match="trace workload"):
        Arrivals("trace").offsets(3)
    with pytest.raises(ValueError, match="fewer"):
        Arrivals("trace").offsets(3, trace_offsets_s=[0.0])
