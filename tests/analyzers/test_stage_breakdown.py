"""breakdown(): stage shares by tenant and class; the shares-sum-to-one invariant."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.stage_breakdown import STAGE_LABELS, breakdown, unattributed
from tokentrace.schema import UNATTRIBUTED_LABEL, Stage, col


@pytest.fixture
def two_tenants(handmade):
    """r1 (tenant a, interactive): token 0 = queue 0-4, prefill 4-10.
    r2 (tenant b, batch): token 0 = queue 5-19, prefill 19-25; token 1 = decode.compute 25-27."""
    h = handmade
    h.request(1, 0, 10, tenant="a").tokens(1, [10])
    h.span(1, Stage.SCHEDULE_QUEUE, 0, 4, 0).span(1, Stage.PREFILL_COMPUTE, 4, 10, 0)
    h.request(2, 5, 27, tenant="b", cls="batch").tokens(2, [25, 27])
    h.span(2, Stage.SCHEDULE_QUEUE, 5, 19, 0).span(2, Stage.PREFILL_COMPUTE, 19, 25, 0)
    h.span(2, Stage.DECODE_COMPUTE, 25, 27, 1)
    return h.source()


CASES = [  # (by, group, stage, column, expected)
    ("tenant", "a", "schedule.queue", "ttft_share", 4 / 10),
    ("tenant", "b", "schedule.queue", "ttft_share", 14 / 20),
    ("tenant", "b", "schedule.queue", "ttft_mean_ms", 14.0),
    ("tenant", "b", "decode.compute", "itl_share", 1.0),
    ("tenant", "a", "decode.compute", "itl_share", math.nan),  # a has no ITL tokens
    ("slo_class", "batch", "prefill.compute", "ttft_tail_share", 6 / 20),
    ("slo_class", "interactive", UNATTRIBUTED_LABEL, "ttft_share", 0.0),
    (None, None, "schedule.queue", "ttft_share", 18 / 30),
]


@pytest.mark.parametrize(("by", "group", "stage", "column", "expected"), CASES)
def test_breakdown_by_group(two_tenants, by, group, stage, column, expected):
    df = breakdown(two_tenants, by=by)
    if by is not None:
        key = {"tenant": col.TENANT, "slo_class": col.SLO_CLASS}[by]
        df = df[df[key] == group]
    value = df.set_index("stage").loc[stage, column]
    if math.isnan(expected):
        assert math.isnan(value)
    else:
        assert value == pytest.approx(expected)


def test_rows_are_every_stage_then_unattributed(two_tenants):
    df = breakdown(two_tenants, by="tenant")
    assert list(df[df[col.TENANT] == "a"]["stage"]) == STAGE_LABELS
    assert len(df) == 2 * len(STAGE_LABELS)


def test_tail_is_the_slowest_one_percent(handmade):
    # 200 ITL tokens: 198 of 1 ms all decode.compute, two of 10 ms all decode.queue -> tail = those two.
    h = handmade.request(1, 0, 1000)
    times, t = [0.0], 0.0
    for i in range(1, 201):
        t += 10 if i in (50, 150) else 1
        times.append(t)
        stage = Stage.DECODE_QUEUE if i in (50, 150) else Stage.DECODE_COMPUTE
        h.span(1, stage, times[i - 1], t, i)
    h.tokens(1, times)
    df = breakdown(h.source()).set_index("stage")
    assert df.loc["decode.queue", "itl_tail_share"] == 1.0
    assert df.loc["decode.queue", "itl_share"] == pytest.approx(20 / 218)


def test_unattributed_is_signed_and_never_floored(handmade):
    # Token 0: 10 ms, spans cover 12 ms (2 ms double-counted) -> -2 ms, not floored to 0.
    # Token 1: 10 ms, spans cover 6 -> 4 unattributed. Overlap is its own figure (analyzers.attribution).
    h = handmade.request(1, 0, 20).tokens(1, [10, 20])
    h.span(1, Stage.SCHEDULE_QUEUE, 0, 6, 0).span(1, Stage.PREFILL_COMPUTE, 4, 10, 0)
    h.span(1, Stage.DECODE_COMPUTE, 10, 16, 1)
    assert unattributed(h.source()) == pytest.approx((4 - 2) / 20)
    shares = breakdown(h.source()).set_index("stage")
    assert shares.loc[UNATTRIBUTED_LABEL, "ttft_share"] == pytest.approx(-0.2)  # the same sign in the breakdown


def test_bad_tail_fraction(two_tenants):
    with pytest.raises(ValueError):
        breakdown(two_tenants, tail_fraction=0)


@st.composite
def runs(draw):
    """Requests with 1..4 tokens; each token's interval gets 0..3 random spans (may overlap or overrun)."""
    requests = []
    for rid in range(1, draw(st.integers(1, 5)) + 1):
        gaps = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
        spans = [draw(st.lists(st.tuples(st.sampled_from(list(Stage)), st.integers(0, 50)), max_size=3))
                 for _ in gaps]
        requests.append((rid, gaps, spans))
    return requests


@settings(max_examples=10, deadline=None)
@given(run=runs())
def test_stage_shares_sum_to_one(make_store, run):
    h = make_store()
    for rid, gaps, spans in run:
        arrival = float(rid)
        times, t = [], arrival
        for i, (gap, token_spans) in enumerate(zip(gaps, spans)):
            start = t
            t += gap
            times.append(t)
            for stage, length in token_spans:
                h.span(rid, stage, start, start + length, i)
        h.request(rid, arrival, t, tenant=f"t{rid % 2}").tokens(rid, times)
    df = breakdown(h.source(), by="tenant")
    for _, g in df.groupby(col.TENANT):
        for column in ("ttft_share", "ttft_tail_share", "itl_share", "itl_tail_share"):
            if g[column].notna().all():
                assert g[column].sum() == pytest.approx(1.0)
            else:
                assert g[column].isna().all()
