"""Groupings: one check of a time window (``window_s``) for every analysis that takes one."""

from __future__ import annotations

import math

import pytest
from handmade import HandMade

from analyzers import cache, capacity, latency, neighbours, slo, stage_breakdown
from analyzers.groups import check_window_s
from analyzers.source import Source
from tokentrace.schema import Role

BAD = [0, -1.0, math.nan, math.inf, "1", True]


@pytest.mark.parametrize("window_s", [None, 0.5, 2, 1e-3])
def test_a_positive_finite_window_or_none_passes(window_s: object) -> None:
    check_window_s(window_s)  # type: ignore[arg-type]


@pytest.mark.parametrize("window_s", BAD)
def test_a_window_that_is_not_a_positive_number_of_seconds_is_refused(window_s: object) -> None:
    with pytest.raises(ValueError, match="window_s must be a positive number of seconds"):
        check_window_s(window_s)  # type: ignore[arg-type]


def _source() -> Source:
    h = HandMade()
    h.instance(1, Role.COLOCATED)
    h.request(1, 0.0, 30.0)
    h.tokens(1, [10.0, 20.0, 30.0])
    return Source.of_tables(**h.tables())


@pytest.mark.parametrize("call", [
    lambda src, w: latency.latency(src, window_s=w),
    lambda src, w: stage_breakdown.breakdown(src, window_s=w),
    lambda src, w: cache.hit_rate_over_time(src, window_s=w),
    lambda src, w: neighbours.noisy_neighbours(src, window_s=w),
    lambda src, w: slo.goodput(src, window_s=w),
    lambda src, w: capacity.throughput(src, window_s=w),
], ids=["latency", "breakdown", "cache", "neighbours", "slo", "capacity"])
def test_every_analysis_refuses_a_bad_window_in_the_same_words(call) -> None:
    src = _source()
    for window_s in (0, -2.5, math.nan):
        with pytest.raises(ValueError, match=r"^window_s must be a positive number of seconds, got "):
            call(src, window_s)
