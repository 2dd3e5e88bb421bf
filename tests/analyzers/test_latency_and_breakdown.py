"""Latency and stage-breakdown analyzers over small hand-made stores."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from analyzers.latency import latency_summary
from analyzers.stage_breakdown import stage_breakdown, token_stage_times, unattributed_share
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, UNATTRIBUTED_LABEL, Role, Stage, col

MS = 1_000_000


def _table(t, rows: list[dict]) -> pa.Table:
    data = {c.name: [r.get(c.name) for r in rows] for c in t.columns}
    return pa.Table.from_pydict(data, schema=t.schema)


def _instances(*rows: tuple[int, Role, int]) -> pa.Table:
    return _table(INSTANCES, [{col.INSTANCE_ID: i, col.ROLE: int(r), col.NAME: "", col.HOST: "h", col.PID: 1,
                               col.MONO_ANCHOR_NS: 0, col.WALL_ANCHOR_NS: 0, col.CLOCK_OFFSET_NS: off}
                              for i, r, off in rows])


def _request(rid: int, arrival: int, finish: int, inst: int = 1) -> dict:
    return {col.REQUEST_ID: rid, col.REQUEST_KEY: f"r{rid}", col.INSTANCE_ID: inst, col.TENANT: "t",
            col.SLO_CLASS: "interactive", col.ARRIVAL_NS: arrival, col.FINISH_NS: finish, col.STATUS: 0}


def _token(rid: int, idx: int, emit: int, inst: int = 1) -> dict:
    return {col.REQUEST_ID: rid, col.TOKEN_INDEX: idx, col.EMIT_NS: emit, col.INSTANCE_ID: inst}


def _span(rid: int, stage: Stage, start: int, end: int, idx: int, inst: int = 1) -> dict:
    return {col.REQUEST_ID: rid, col.STAGE: int(stage), col.TOKEN_INDEX: idx, col.START_NS: start,
            col.END_NS: end, col.INSTANCE_ID: inst}


@pytest.fixture
def store():
    """Two requests. r1: arrival 0, tokens at 10, 14, 20 ms. r2: arrival 5, tokens at 25, 27 ms.

    r1 token 0: queue 0-4, prefill 4-10. token 1: dq 10-11, dc 11-14. token 2: dq 14-16, dc 16-19,
    1 ms unattributed (19-20). r2 token 0: queue 5-19, prefill 19-25. token 1: dc 25-27.
    """
    requests = _table(REQUESTS, [_request(1, 0, 20 * MS), _request(2, 5 * MS, 27 * MS)])
    tokens = _table(TOKENS, [_token(1, 0, 10 * MS), _token(1, 1, 14 * MS), _token(1, 2, 20 * MS),
                             _token(2, 0, 25 * MS), _token(2, 1, 27 * MS)])
    spans = _table(SPANS, [
        _span(1, Stage.SCHEDULE_QUEUE, 0, 4 * MS, 0), _span(1, Stage.PREFILL_COMPUTE, 4 * MS, 10 * MS, 0),
        _span(1, Stage.DECODE_QUEUE, 10 * MS, 11 * MS, 1), _span(1, Stage.DECODE_COMPUTE, 11 * MS, 14 * MS, 1),
        _span(1, Stage.DECODE_QUEUE, 14 * MS, 16 * MS, 2), _span(1, Stage.DECODE_COMPUTE, 16 * MS, 19 * MS, 2),
        _span(2, Stage.SCHEDULE_QUEUE, 5 * MS, 19 * MS, 0), _span(2, Stage.PREFILL_COMPUTE, 19 * MS, 25 * MS, 0),
        _span(2, Stage.DECODE_COMPUTE, 25 * MS, 27 * MS, 1),
    ])
    return spans, requests, tokens, _instances((1, Role.COLOCATED, 0))


def _metric(df, name):
    return df.set_index("metric").loc[name]


def test_latency_definitions(store):
    _, requests, tokens, instances = store
    df = latency_summary(requests, tokens, instances)
    ttft = _metric(df, "ttft")
    assert ttft["count"] == 2 and ttft["mean_ms"] == pytest.approx(15.0)  # 10 and 20
    itl = _metric(df, "itl")
    assert itl["count"] == 3 and itl["mean_ms"] == pytest.approx((4 + 6 + 2) / 3)
    tpot = _metric(df, "tpot")
    assert tpot["mean_ms"] == pytest.approx((5 + 2) / 2)  # r1: (20-10)/2, r2: (27-25)/1
    e2e = _metric(df, "e2e")
    assert e2e["p50_ms"] == pytest.approx(21.0)  # 20 and 22
    assert ttft["p50_ms"] <= ttft["p90_ms"] <= ttft["p99_ms"] <= ttft["p99.9_ms"]


def test_stage_shares_and_unattributed(store):
    df = stage_breakdown(*store).set_index("stage")
    # TTFT: r1 10 ms (queue 4, prefill 6), r2 20 ms (queue 14, prefill 6) -> 30 ms in all.
    assert df.loc["schedule.queue", "ttft_share"] == pytest.approx(18 / 30)
    assert df.loc["prefill.compute", "ttft_share"] == pytest.approx(12 / 30)
    assert df.loc["schedule.queue", "ttft_mean_ms"] == pytest.approx(9.0)
    # ITL: 4 + 6 + 2 = 12 ms; decode.compute 3 + 3 + 2, decode.queue 1 + 2, unattributed 1.
    assert df.loc["decode.compute", "itl_share"] == pytest.approx(8 / 12)
    assert df.loc["decode.queue", "itl_share"] == pytest.approx(3 / 12)
    assert df.loc[UNATTRIBUTED_LABEL, "itl_share"] == pytest.approx(1 / 12)
    # The slowest ITL token (r1 token 2, 6 ms): queue 2, compute 3, unattributed 1.
    assert df.loc["decode.queue", "itl_tail_share"] == pytest.approx(2 / 6)
    for kind in ("ttft_share", "itl_share", "ttft_tail_share", "itl_tail_share"):
        assert math.isclose(df[kind].sum(), 1.0)
    assert unattributed_share(*store) == pytest.approx(1 / 42)


def test_clock_offsets_align_instances(store):
    spans, requests, tokens, _ = store
    # Record the same facts on an instance whose clock runs 1 s behind: offset +1 s.
    skew = 1_000 * MS

    def shifted(t: pa.Table, names: list[str]) -> pa.Table:
        for n in names:
            i = t.schema.get_field_index(n)
            t = t.set_column(i, t.schema.field(i), pc.subtract(t.column(n), skew))
        return t

    spans2 = shifted(spans, [col.START_NS, col.END_NS])
    requests2 = shifted(requests, [col.ARRIVAL_NS, col.FINISH_NS])
    tokens2 = shifted(tokens, [col.EMIT_NS])
    instances = _instances((1, Role.COLOCATED, skew))
    assert stage_breakdown(spans2, requests2, tokens2, instances).equals(stage_breakdown(*store))


def test_client_rows_are_not_part_of_the_server_view(store):
    spans, requests, tokens, _ = store
    client_req = _table(REQUESTS, [_request(1, -50 * MS, 30 * MS, inst=9)])
    client_tok = _table(TOKENS, [{col.REQUEST_ID: 1, col.TOKEN_INDEX: 0, col.RECV_NS: 40 * MS, col.INSTANCE_ID: 9}])
    instances = _instances((1, Role.COLOCATED, 0), (9, Role.CLIENT, 0))
    df = latency_summary(pa.concat_tables([requests, client_req]), pa.concat_tables([tokens, client_tok]), instances)
    assert _metric(df, "ttft")["mean_ms"] == pytest.approx(15.0)


def test_token_stage_times_has_one_row_per_token(store):
    t = token_stage_times(*store)
    assert len(t) == 5
    assert set(t[col.TOKEN_INDEX]) == {0, 1, 2}


def test_span_time_counts_only_inside_its_tokens_interval(store):
    """An engine span of token 1 that began while token 0 was still being delivered
    (pipelining across processes) is clipped at token 1's start."""
    spans, requests, tokens, instances = store
    early = _table(SPANS, [_span(2, Stage.DECODE_QUEUE, 23 * MS, 25 * MS, 1)])  # before t_0 = 25 ms
    df = stage_breakdown(pa.concat_tables([spans, early]), requests, tokens, instances).set_index("stage")
    assert df.loc["decode.queue", "itl_share"] == pytest.approx(3 / 12)  # unchanged: 0 ms inside
    assert df.loc[UNATTRIBUTED_LABEL, "itl_share"] == pytest.approx(1 / 12)
