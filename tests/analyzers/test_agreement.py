"""The agreement analyzer over small hand-made stores with hand-computed answers."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from analyzers.agreement import (
    CLIENT_NS,
    DIFF_NS,
    SERVER_NS,
    STAGE_DIFF_NS,
    STAGE_SUM_NS,
    agreement_summary,
    client_token_times,
    itl_agreement,
    token_agreement,
    ttft_agreement,
)
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, Role, Stage, col

MS = 1_000_000
SERVER, CLIENT = 1, 9


def _table(t, rows: list[dict]) -> pa.Table:
    return pa.Table.from_pydict({c.name: [r.get(c.name) for r in rows] for c in t.columns}, schema=t.schema)


def _instances(client_offset: int = 0) -> pa.Table:
    rows = [(SERVER, Role.COLOCATED, 0), (CLIENT, Role.CLIENT, client_offset)]
    return _table(INSTANCES, [{col.INSTANCE_ID: i, col.ROLE: int(r), col.NAME: "", col.HOST: "h", col.PID: 1,
                               col.MONO_ANCHOR_NS: 0, col.WALL_ANCHOR_NS: 0, col.CLOCK_OFFSET_NS: off}
                              for i, r, off in rows])


def _request(rid: int, inst: int, arrival: int, finish: int) -> dict:
    return {col.REQUEST_ID: rid, col.REQUEST_KEY: f"r{rid}", col.INSTANCE_ID: inst, col.TENANT: "",
            col.SLO_CLASS: "", col.ARRIVAL_NS: arrival, col.FINISH_NS: finish, col.STATUS: 0}


def _store(client_shift: int = 0):
    """Request 1. Client: sent 0, received 11, 15.5, 20.5 ms. Server: arrival 1 ms, tokens sent 10, 14,
    20 ms; spans token 0: 1-4 + 4-10 (9 ms), token 1: 10-14 (4 ms), token 2: 14-19 (5 ms).
    Request 2 was seen only by the client (the server never recorded it).
    ``client_shift``: the client's clock reads that much less (its offset in instances fixes it)."""
    s = client_shift
    requests = _table(REQUESTS, [
        _request(1, SERVER, 1 * MS, 20 * MS), _request(1, CLIENT, 0 - s, 21 * MS - s),
        _request(2, CLIENT, 30 * MS - s, 40 * MS - s),
    ])
    tokens = _table(TOKENS, [
        {col.REQUEST_ID: 1, col.TOKEN_INDEX: i, col.SENT_NS: t, col.INSTANCE_ID: SERVER}
        for i, t in enumerate((10 * MS, 14 * MS, 20 * MS))
    ] + [
        {col.REQUEST_ID: 1, col.TOKEN_INDEX: i, col.RECV_NS: t - s, col.INSTANCE_ID: CLIENT}
        for i, t in enumerate((11 * MS, 15_500_000, 20_500_000))
    ] + [{col.REQUEST_ID: 2, col.TOKEN_INDEX: 0, col.RECV_NS: 35 * MS - s, col.INSTANCE_ID: CLIENT}])
    spans = _table(SPANS, [
        {col.REQUEST_ID: 1, col.STAGE: int(st), col.TOKEN_INDEX: i, col.START_NS: a, col.END_NS: b,
         col.INSTANCE_ID: SERVER}
        for st, i, a, b in ((Stage.SCHEDULE_QUEUE, 0, 1 * MS, 4 * MS), (Stage.PREFILL_COMPUTE, 0, 4 * MS, 10 * MS),
                            (Stage.DECODE_COMPUTE, 1, 10 * MS, 14 * MS), (Stage.DECODE_COMPUTE, 2, 14 * MS, 19 * MS))
    ])
    return requests, tokens, _instances(client_shift), spans


def test_client_view_per_token():
    requests, tokens, instances, _ = _store()
    df = client_token_times(requests, tokens, instances)
    got = {(r[col.REQUEST_ID], r[col.TOKEN_INDEX]): r[CLIENT_NS] for _, r in df.iterrows()}
    assert got == {(1, 0): 11 * MS, (1, 1): 4_500_000, (1, 2): 5 * MS, (2, 0): 5 * MS}


def test_token_differences_are_server_minus_client():
    requests, tokens, instances, spans = _store()
    df = token_agreement(requests, tokens, instances, spans)
    assert list(df[col.TOKEN_INDEX]) == [0, 1, 2]  # request 2 has no server view: left out
    assert list(df[SERVER_NS]) == [9 * MS, 4 * MS, 6 * MS]
    assert list(df[DIFF_NS]) == [-2 * MS, -500_000, 1 * MS]
    assert list(df[STAGE_SUM_NS]) == [9 * MS, 4 * MS, 5 * MS]
    assert list(df[STAGE_DIFF_NS]) == [-2 * MS, -500_000, 0]
    assert len(ttft_agreement(requests, tokens, instances, spans)) == 1
    assert len(itl_agreement(requests, tokens, instances, spans)) == 2


def test_clock_offsets_are_applied_before_comparing():
    shifted = _store(client_shift=100 * MS)
    plain = _store()
    a = token_agreement(*shifted)
    b = token_agreement(*plain)
    assert list(a[DIFF_NS]) == list(b[DIFF_NS])


def test_summary_distribution():
    requests, tokens, instances, spans = _store()
    df = agreement_summary(requests, tokens, instances, spans).set_index("metric")
    assert df.loc["ttft", "count"] == 1 and df.loc["ttft", "mean_ms"] == pytest.approx(-2.0)
    assert df.loc["itl", "count"] == 2
    assert df.loc["itl", "mean_ms"] == pytest.approx(0.25)
    assert df.loc["itl", "max_abs_ms"] == pytest.approx(1.0)
    assert df.loc["itl", "p50_ms"] == pytest.approx(0.25)
    assert df.loc["itl_stages", "max_abs_ms"] == pytest.approx(0.5)


def test_without_spans_the_stage_columns_are_empty():
    requests, tokens, instances, _ = _store()
    df = agreement_summary(requests, tokens, instances)
    row = df.set_index("metric").loc["itl_stages"]
    assert row["count"] == 0 and math.isnan(row["mean_ms"])
    assert df.set_index("metric").loc["ttft", "count"] == 1


def test_no_client_rows_gives_empty_results():
    requests, tokens, instances, spans = _store()
    server_only = _table(INSTANCES, [r for r in instances.to_pylist() if r[col.INSTANCE_ID] == SERVER])
    keep = [r for r in requests.to_pylist() if r[col.INSTANCE_ID] == SERVER]
    df = token_agreement(_table(REQUESTS, keep), tokens, server_only, spans)
    assert df.empty


def test_a_held_back_token_is_compared_as_part_of_the_chunk_that_carried_it():
    """Server token 1 completed no character: the gateway received it at 12 ms (recv_ns, no
    sent_ns) and sent its text with token 2's chunk at 20 ms. The client saw two chunks after
    the first, at 11 and 20.5 ms: its chunk 1 is server tokens 1 + 2 (10 -> 12 -> 20 ms)."""
    requests, tokens, instances, spans = _store()
    rows = [r for r in tokens.to_pylist() if not (r[col.INSTANCE_ID] == SERVER and r[col.TOKEN_INDEX] == 1)]
    rows = [r for r in rows if not (r[col.INSTANCE_ID] == CLIENT and r[col.TOKEN_INDEX] == 2)]
    for r in rows:
        if r[col.INSTANCE_ID] == CLIENT and r[col.TOKEN_INDEX] == 1:
            r[col.RECV_NS] = 20_500_000
    rows.append({col.REQUEST_ID: 1, col.TOKEN_INDEX: 1, col.RECV_NS: 12 * MS, col.INSTANCE_ID: SERVER})
    held = pa.Table.from_pylist(rows, schema=TOKENS.schema)
    df = token_agreement(requests, held, instances, spans)
    assert list(df[col.TOKEN_INDEX]) == [0, 1]
    assert list(df[CLIENT_NS]) == [11 * MS, 9_500_000]
    assert list(df[SERVER_NS]) == [9 * MS, 2 * MS + 8 * MS]  # token 1 (10 -> 12) + token 2 (12 -> 20)
    assert list(df[STAGE_SUM_NS]) == [9 * MS, 2 * MS + 5 * MS]  # decode 10-12 clipped, 14-19
    assert list(df[DIFF_NS]) == [-2 * MS, 500_000]


def test_the_tail_is_the_absolute_difference_and_no_row_repeats_ttft():
    """Server - client ITL differences of -0.5 and +1.0 ms: the signed p50 is the bias (0.25), the tail is
    |diff| (p99 near 1.0), whichever side it is on."""
    requests, tokens, instances, spans = _store()
    df = agreement_summary(requests, tokens, instances, spans).set_index("metric")
    assert "ttft_stages" not in df.index and "p99_ms" not in df.columns
    assert df.loc["itl", "p99_abs_ms"] == pytest.approx(0.5 + 0.99 * 0.5)
    assert df.loc["itl", "p50_abs_ms"] == pytest.approx(0.75)
    assert df.loc["itl", "max_ms"] == pytest.approx(1.0)
    assert df.loc["ttft", "max_ms"] == pytest.approx(-2.0) and df.loc["ttft", "p99_abs_ms"] == pytest.approx(2.0)
