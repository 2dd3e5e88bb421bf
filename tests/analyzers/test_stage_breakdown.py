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


def _spread_run(h, ids: list[int]):
    """Requests ``ids``, each: token 0 (queue, then a prefill overrunning it by 0.5 ms), tokens 1 and 2 (the
    second's decode starts 0.5 ms before its interval); a span of a token never delivered and one of a request
    without tokens count nowhere."""
    for n, rid in enumerate(ids):
        a = 10.0 * n
        h.request(rid, a, a + 6, tenant=f"t{n % 2}").tokens(rid, [a + 4, a + 5, a + 6])
        h.span(rid, Stage.SCHEDULE_QUEUE, a, a + 3, 0).span(rid, Stage.PREFILL_COMPUTE, a + 3, a + 4.5, 0)
        h.span(rid, Stage.DECODE_COMPUTE, a + 4, a + 5, 1).span(rid, Stage.DECODE_COMPUTE, a + 4.5, a + 6, 2)
    h.span(ids[0], Stage.DECODE_COMPUTE, 0, 1, 7)
    h.span(2**62 + 5, Stage.DECODE_COMPUTE, 0, 1, 0)
    return h.source()


def test_join_key_falls_back_when_it_would_overflow(make_store):
    """Spans find their tokens by one BIGINT key when (request id span) * (token indexes) fits, else by two
    columns: the same breakdown either way, and a span outside the tokens' bounds counts nowhere in both."""
    from analyzers.attribution import _token_key

    small, spread = _spread_run(make_store(), [1, 2]), _spread_run(make_store(), [1, 2**62])
    assert _token_key(small) == (1, 3, 2)
    assert _token_key(spread) is None  # 2**62 request ids times 3 token indexes exceed a BIGINT
    a, b = breakdown(small, by="tenant"), breakdown(spread, by="tenant")
    assert a.equals(b)
    queue = a[a[col.TENANT] == "t0"].set_index("stage").loc["schedule.queue"]
    assert queue["ttft_share"] == pytest.approx(3 / 4) and queue["ttft_mean_ms"] == pytest.approx(3.0)
    decode = a[a[col.TENANT] == "t0"].set_index("stage").loc["decode.compute"]
    assert decode["itl_share"] == pytest.approx(2 / 2)  # token 2's decode clipped to its 1 ms interval


def _request_stage_rows(src) -> list[tuple]:
    from analyzers.stage_breakdown import request_stage_ns

    c = col
    rows = src.arrow(f"SELECT {c.REQUEST_ID}, {c.STAGE}, {c.ROLE}, ns, first_ns, first_start_ns "
                     f"FROM {request_stage_ns(src)} ORDER BY {c.STAGE}").to_pylist()
    return [tuple(r.values()) for r in rows]


def test_roles_by_case_and_by_join_agree(handmade, monkeypatch):
    """A run's few instances give a span its role by a CASE, many by a join to the instances: the same rows, two
    instances of one role summed together, an instance missing from the instances table with a null role."""
    import analyzers.stage_breakdown as sb
    from tokentrace.schema import Role

    h = handmade
    for iid in range(1, sb._ROLE_CASES + 2):
        h.instance(iid, Role.PREFILL if iid % 2 else Role.DECODE)
    h.request(1, 0, 10).tokens(1, [6, 10], inst=2)
    h.span(1, Stage.PREFILL_COMPUTE, 0, 4, 0, inst=1).span(1, Stage.PREFILL_COMPUTE, 4, 6, 0, inst=3)
    h.span(1, Stage.DECODE_COMPUTE, 6, 10, 1, inst=2).span(1, Stage.DETOKENIZE, 5, 6, 0, inst=99)
    ms = 1_000_000
    expected = [(1, int(Stage.PREFILL_COMPUTE), int(Role.PREFILL), 6 * ms, 6 * ms, 0),
                (1, int(Stage.DECODE_COMPUTE), int(Role.DECODE), 4 * ms, None, None),
                (1, int(Stage.DETOKENIZE), None, 1 * ms, 1 * ms, 5 * ms)]
    expected.sort(key=lambda r: r[1])
    joined = _request_stage_rows(h.source())
    monkeypatch.setattr(sb, "_ROLE_CASES", 4 * sb._ROLE_CASES)
    assert sb._role_sql(h.source(), "x")[1] == ""  # a CASE now
    cased = _request_stage_rows(h.source())
    assert joined == cased == expected
