"""critical_path() and slowest_requests() over a hand-made store."""

from __future__ import annotations

import pytest

from analyzers.critical_path import critical_path, slowest_requests
from tokentrace.schema import UNATTRIBUTED_LABEL, Stage, col


@pytest.fixture
def three(handmade):
    """TTFTs 10, 20, 100 ms.

    r1: queue 0-2, cache.lookup 2-3, prefill 3-10; finish 12.
    r2: queue 0-10, prefill 10-20; finish 30.
    r3: queue 0-80, prefill 80-95, 5 ms unattributed, first token at 100; finish 100.
    P45..P55 of TTFT = 19..28 ms -> the p50 group is r2; P99..P100 = 98.4..100 -> the p99 group is r3.
    """
    h = handmade
    h.request(1, 0, 12).tokens(1, [10])
    h.span(1, Stage.SCHEDULE_QUEUE, 0, 2, 0).span(1, Stage.CACHE_LOOKUP, 2, 3, 0)
    h.span(1, Stage.PREFILL_COMPUTE, 3, 10, 0)
    h.request(2, 0, 30).tokens(2, [20])
    h.span(2, Stage.SCHEDULE_QUEUE, 0, 10, 0).span(2, Stage.PREFILL_COMPUTE, 10, 20, 0)
    h.request(3, 0, 100).tokens(3, [100])
    h.span(3, Stage.SCHEDULE_QUEUE, 0, 80, 0).span(3, Stage.PREFILL_COMPUTE, 80, 95, 0)
    return h.source()


CASES = [  # (group, position, stage, mean_ms, share, offset_ms)
    ("p50", 0, "schedule.queue", 10.0, 0.5, 0.0),
    ("p50", 1, "prefill.compute", 10.0, 0.5, 10.0),
    ("p99", 0, "schedule.queue", 80.0, 0.8, 0.0),
    ("p99", 1, "prefill.compute", 15.0, 0.15, 80.0),
]


@pytest.mark.parametrize(("group", "position", "stage", "mean_ms", "share", "offset"), CASES)
def test_critical_path(three, group, position, stage, mean_ms, share, offset):
    df = critical_path(three)
    row = df[(df["group"] == group) & (df["position"] == position)].iloc[0]
    assert row["stage"] == stage
    assert row["mean_ms"] == pytest.approx(mean_ms)
    assert row["share_of_ttft"] == pytest.approx(share)
    assert row["mean_start_offset_ms"] == pytest.approx(offset)


def test_unattributed_closes_the_chain(three):
    df = critical_path(three)
    p99 = df[df["group"] == "p99"]
    assert list(p99["stage"]) == ["schedule.queue", "prefill.compute", UNATTRIBUTED_LABEL]
    assert p99["share_of_ttft"].sum() == pytest.approx(1.0)
    assert len(df[df["group"] == "p50"]) == 2  # r2 is fully attributed


def test_slowest_requests(three):
    df = slowest_requests(three, n=2)
    assert list(df[col.REQUEST_ID]) == [3, 2]
    assert list(df["e2e_ms"]) == pytest.approx([100.0, 30.0])
    assert df.iloc[0]["schedule.queue"] == pytest.approx(80.0)
    assert df.iloc[0][UNATTRIBUTED_LABEL] == pytest.approx(5.0)
    assert df.iloc[1][UNATTRIBUTED_LABEL] == pytest.approx(10.0)  # finish 30, spans end at 20
    assert df.iloc[1][col.REQUEST_KEY] == "r2"


def test_bad_n(three):
    with pytest.raises(ValueError):
        slowest_requests(three, n=0)


def test_empty(handmade):
    assert critical_path(handmade.source()).empty
    assert slowest_requests(handmade.source()).empty
