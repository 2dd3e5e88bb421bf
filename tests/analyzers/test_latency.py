"""latency(): TTFT / TPOT / ITL / E2E overall and by tenant, SLO class, instance and time window."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.groups import WINDOW_START
from analyzers.latency import latency
from tokentrace.schema import Role, col


@pytest.fixture
def three(handmade):
    """r1 (tenant a, interactive, inst 1): arrival 0, tokens 10, 14, 20, finish 20.
    r2 (tenant b, batch, inst 1): arrival 5, tokens 25, 27, finish 30.
    r3 (tenant b, interactive, inst 2): arrival 1000, token 1030, finish 1040."""
    h = handmade.instance(1, Role.COLOCATED).instance(2, Role.COLOCATED)
    h.request(1, 0, 20, tenant="a", cls="interactive").tokens(1, [10, 14, 20])
    h.request(2, 5, 30, tenant="b", cls="batch").tokens(2, [25, 27])
    h.request(3, 1000, 1040, tenant="b", cls="interactive", inst=2).tokens(3, [1030], inst=2)
    return h.source()


def _cell(df, key, group, metric, column):
    row = df[(df[key] == group) & (df["metric"] == metric)]
    assert len(row) == 1, (group, metric)
    return row.iloc[0][column]


# (by, group, metric, column, expected) -- hand-computed from the fixture's docstring.
CASES = [
    ("tenant", "a", "ttft", "mean_ms", 10.0),
    ("tenant", "a", "itl", "p50_ms", 5.0),          # ITLs 4 and 6
    ("tenant", "a", "tpot", "mean_ms", 5.0),        # (20 - 10) / 2
    ("tenant", "b", "ttft", "mean_ms", 25.0),       # 20 and 30
    ("tenant", "b", "ttft", "p90_ms", 29.0),        # 20 + 0.9 * 10
    ("tenant", "b", "tpot", "count", 1),            # r3 has one token: no TPOT
    ("tenant", "b", "e2e", "mean_ms", 32.5),        # 25 and 40
    ("slo_class", "interactive", "ttft", "mean_ms", 20.0),
    ("slo_class", "interactive", "itl", "count", 2),
    ("slo_class", "batch", "itl", "mean_ms", 2.0),
    ("instance", 1, "ttft", "mean_ms", 15.0),
    ("instance", 2, "e2e", "mean_ms", 40.0),
]


@pytest.mark.parametrize(("by", "group", "metric", "column", "expected"), CASES)
def test_latency_by_group(three, by, group, metric, column, expected):
    df = latency(three, by=by)
    key = {"tenant": col.TENANT, "slo_class": col.SLO_CLASS, "instance": col.INSTANCE_ID}[by]
    assert _cell(df, key, group, metric, column) == pytest.approx(expected)


def test_latency_by_window_puts_requests_in_their_arrival_window(three):
    df = latency(three, window_s=0.5)
    assert sorted(df[WINDOW_START].unique()) == [0.0, 1.0]
    assert _cell(df, WINDOW_START, 0.0, "ttft", "mean_ms") == pytest.approx(15.0)
    assert _cell(df, WINDOW_START, 1.0, "ttft", "mean_ms") == pytest.approx(30.0)
    assert _cell(df, WINDOW_START, 1.0, "tpot", "count") == 0
    assert math.isnan(_cell(df, WINDOW_START, 1.0, "tpot", "mean_ms"))


def test_every_group_has_the_four_metrics(three):
    df = latency(three, by="tenant")
    assert len(df) == 8
    assert list(df["metric"][:4]) == ["ttft", "tpot", "itl", "e2e"]


def test_sent_times_win_over_emit_times(handmade):
    h = handmade.request(1, 0, 50).tokens(1, [10, 20]).tokens(1, [12, 26], kind="sent")
    df = latency(h.source())
    assert df.set_index("metric").loc["ttft", "mean_ms"] == pytest.approx(12.0)
    assert df.set_index("metric").loc["itl", "mean_ms"] == pytest.approx(14.0)


@pytest.mark.parametrize("kwargs", [{"by": "region"}, {"by": "tenant", "window_s": 1.0}, {"window_s": 0},
                                    {"window_s": float("nan")}])
def test_bad_grouping_is_a_value_error(three, kwargs):
    with pytest.raises(ValueError):
        latency(three, **kwargs)


def test_empty_store_gives_nan_rows(handmade):
    df = latency(handmade.source())
    assert list(df["count"]) == [0, 0, 0, 0]
    assert df["p99_ms"].isna().all()


@settings(max_examples=10, deadline=None)
@given(gaps=st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=1, max_size=8))
def test_percentiles_are_monotone(make_store, gaps):
    h = make_store()
    for rid, request_gaps in enumerate(gaps, start=1):
        times, t = [], float(rid)
        for g in request_gaps:
            t += g
            times.append(t)
        h.request(rid, float(rid), t + 1).tokens(rid, times)
    df = latency(h.source())
    for _, r in df[df["count"] > 0].iterrows():
        assert r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["p99.9_ms"]
        assert r["p50_ms"] >= 0
    assert df.set_index("metric").loc["ttft", "count"] == len(gaps)


def test_ttft_ends_at_the_first_chunk_with_visible_text(handmade):
    """Token 0 completed no character: the gateway received it at 8 ms and held it back (recv_ns);
    its text went out with token 1's chunk at 12 ms, the first with content (first_content_ns). TTFT
    is 12 ms, the definition of AIPerf and vllm bench, not the 8 ms of token 0's own interval."""
    h = handmade.instance(1, Role.GATEWAY)
    h.request(1, 0, 20, first_content=12).tokens(1, [8], kind="recv").tokens(1, [12, 20], kind="sent", first=1)
    lat = latency(h.source()).set_index("metric")
    assert lat.loc["ttft", "mean_ms"] == pytest.approx(12.0)
    assert lat.loc["tpot", "mean_ms"] == pytest.approx((20 - 12) / 2)
    assert lat.loc["e2e", "mean_ms"] == pytest.approx(20.0)
