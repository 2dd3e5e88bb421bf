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


def test_stages_past_the_first_token_or_claiming_the_same_time_never_push_a_share_past_100(handmade):
    """r1 (TTFT 10 ms): a preemption tagged token 0 runs 5-60 ms, past its first token at 10: only 5 ms of it
    is on the path. r2 (TTFT 10 ms): queue 0-10 and a second claim of 0-10 (cache.load): each gets half."""
    h = handmade
    h.request(1, 0, 70).tokens(1, [10])
    h.span(1, Stage.SCHEDULE_QUEUE, 0, 5, 0).span(1, Stage.SCHEDULE_PREEMPTED, 5, 60, 0)
    h.request(2, 0, 30).tokens(2, [10])
    h.span(2, Stage.SCHEDULE_QUEUE, 0, 10, 0).span(2, Stage.CACHE_LOAD, 0, 10, 0)
    df = critical_path(h.source())
    for group, rows in df.groupby("group"):
        assert rows["share_of_ttft"].between(0, 1).all(), rows
        assert rows["share_of_ttft"].sum() == pytest.approx(1.0), rows
        assert (rows["mean_ms"] >= 0).all(), rows
    p99 = df[df["group"] == "p99"].set_index("stage")
    assert UNATTRIBUTED_LABEL not in p99.index
    assert p99["mean_ms"].sum() == pytest.approx(10.0)


def test_a_slowest_requests_stage_counts_only_its_time_inside_the_requests_token_intervals(handmade):
    """The engine (instance 1) runs ahead of the stream (instance 2): it emits token 0 at 4 ms and waits for its
    next step from 4 to 11 ms while token 0 is relayed until 10 ms. Only 10-11 ms of that wait lies in token 1's
    interval [10, 20]; 4-10 ms is token 0's delivery. The stages tile E2E, as the stage breakdown counts them."""
    h = handmade
    h.request(1, 0, 20).tokens(1, [4, 12]).tokens(1, [10, 20], inst=2, kind="sent")
    h.span(1, Stage.SCHEDULE_QUEUE, 0, 4, 0).span(1, Stage.DECODE_QUEUE, 4, 11, 1)
    h.span(1, Stage.DECODE_COMPUTE, 11, 12, 1)
    h.span(1, Stage.STREAM_RELAY, 4, 10, 0, inst=2).span(1, Stage.STREAM_RELAY, 12, 20, 1, inst=2)
    row = slowest_requests(h.source(), n=1).iloc[0]
    assert row["e2e_ms"] == pytest.approx(20.0)
    assert row["decode.queue"] == pytest.approx(1.0)
    assert row["stream.relay"] == pytest.approx(14.0)
    assert row[UNATTRIBUTED_LABEL] == pytest.approx(0.0)
