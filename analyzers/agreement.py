"""How far the server's own timeline disagrees with what an independent client saw.

The load generator (``tokentrace bench``) records, as instance role ``client``,
when it sent each request (``requests.arrival_ns``) and when each token's chunk
arrived (``tokens.recv_ns``). The server side records the same requests (joined on
``request_id``, derived from the ``X-Request-Id`` the client sent). On the run's
reference clock (:meth:`tokentrace.clock.RunClocks.align`):

* client TTFT = recv(token 0) - send; client ITL_i = recv(i) - recv(i-1);
* server TTFT and ITL_i = the server's token latencies (:func:`analyzers.timing.token_intervals`:
  arrival -> token 0 delivered, delivered(i-1) -> delivered(i));
* server stage sum = the sum of the durations of the token's spans (``spans.token_index`` = i),
  each clipped to the token's interval: the quantity the stage breakdown attributes;
* chunks, not tokens, are what a client can count: a server that holds back a token
  with no text yet (part of a UTF-8 character) delivers it with the next chunk, so
  server tokens are grouped into the chunks they went out in (a token with a gateway
  ``sent_ns`` closes a chunk) and the client's ``i``-th chunk is compared with the
  server's ``i``-th: latencies and stage sums add up over a chunk's tokens. Without
  held-back tokens a chunk is a token;
* a client that does not count every chunk the server sent (AIPerf counts only chunks whose
  text is not empty; a server that writes empty chunks, such as the reference gateway before
  it held such tokens back, sends more) is aligned by time instead of by position, per
  request whose chunk counts differ: the client's chunk ``i`` is the server's latest chunk
  sent by the client's receipt (plus :data:`CHUNK_TOLERANCE_NS`), and the
  server chunks since the previous match add up into it, as held-back tokens do;
* differences are server - client: a TTFT difference is normally negative (the
  client also waits for the network and for the server's accept/parse), an ITL
  difference is centred on zero (jitter of delivery).

Pure functions: store tables (Arrow) in, pandas out. No client rows or no server rows
give empty results.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from analyzers.source import client_instance_ids
from analyzers.timing import LATENCY, token_intervals
from tokentrace.clock import RunClocks
from tokentrace.schema import REQUESTS, TOKENS, col

__all__ = ["client_token_times", "token_agreement", "ttft_agreement", "itl_agreement", "agreement_summary",
           "CLIENT_NS", "SERVER_NS", "STAGE_SUM_NS", "DIFF_NS", "STAGE_DIFF_NS", "CHUNK_TOLERANCE_NS", "SPAN_COLUMNS"]

SPAN_COLUMNS = [col.REQUEST_ID, col.STAGE, col.TOKEN_INDEX, col.START_NS, col.END_NS, col.INSTANCE_ID]
"""The span columns the stage sums read (a run's spans can be most of its size: only these are loaded)."""

CLIENT_NS = "client_ns"
"""Client-observed latency of the token (TTFT for token 0, ITL otherwise), ns."""
SERVER_NS = "server_ns"
"""Server-side latency of the same token, ns."""
STAGE_SUM_NS = "server_stage_sum_ns"
"""Sum of the token's stage spans on the server, ns (null when it has no spans)."""
DIFF_NS = "diff_ns"
"""SERVER_NS - CLIENT_NS."""
STAGE_DIFF_NS = "stage_diff_ns"
"""STAGE_SUM_NS - CLIENT_NS."""
CHUNK_TOLERANCE_NS = 5_000_000
"""When chunks are aligned by time, a client's receipt may read up to 5 ms before the server's
send of the same chunk: a send is stamped when the write call returned, which on a busy event
loop comes milliseconds after the bytes left (the real AIPerf run in tests/data shows 2-5 ms),
plus the error of putting two clocks on one."""
_DELIVERED = "delivered_ns"
_SUMMARY_METRICS = (("ttft", DIFF_NS), ("itl", DIFF_NS), ("ttft_stages", STAGE_DIFF_NS), ("itl_stages", STAGE_DIFF_NS))


def _only(t: pa.Table, ids: list[int], keep: bool) -> pa.Table:
    mask = pc.is_in(t.column(col.INSTANCE_ID), value_set=pa.array(ids, pa.int64()))
    return t.filter(mask if keep else pc.invert(mask))


def client_token_times(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """Client view per token: request_id, token_index, client_ns (TTFT for token 0, else ITL).

    Tokens of requests the client never saw a token 0 of are left out.
    """
    clients = client_instance_ids(instances)
    empty = pd.DataFrame({col.REQUEST_ID: pd.Series(dtype="int64"), col.TOKEN_INDEX: pd.Series(dtype="int64"),
                          CLIENT_NS: pd.Series(dtype="int64")})
    if not clients:
        return empty
    clocks = RunClocks.from_instances(instances)
    req = _only(clocks.align(requests, REQUESTS.name), clients, True)
    tok = _only(clocks.align(tokens, TOKENS.name), clients, True)
    if req.num_rows == 0 or tok.num_rows == 0:
        return empty
    exact = {pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int64Dtype()}.get  # ns stay exact (no float64)
    sends = (req.select([col.REQUEST_ID, col.ARRIVAL_NS]).to_pandas(types_mapper=exact)
             .dropna().astype("int64").groupby(col.REQUEST_ID, as_index=False)[col.ARRIVAL_NS].min())
    recv = (tok.select([col.REQUEST_ID, col.TOKEN_INDEX, col.RECV_NS]).to_pandas(types_mapper=exact)
            .dropna().astype("int64")
            .groupby([col.REQUEST_ID, col.TOKEN_INDEX], as_index=False)[col.RECV_NS].min())
    recv = recv.merge(sends, on=col.REQUEST_ID, how="inner").sort_values([col.REQUEST_ID, col.TOKEN_INDEX])
    by_request = recv.groupby(col.REQUEST_ID)
    prev = by_request[col.RECV_NS].shift(1, fill_value=0)
    prev_index = by_request[col.TOKEN_INDEX].shift(1, fill_value=-2)
    first = recv[col.TOKEN_INDEX] == 0
    base = recv[col.ARRIVAL_NS].where(first, prev)
    recv[CLIENT_NS] = recv[col.RECV_NS] - base
    recv = recv[first | (prev_index == recv[col.TOKEN_INDEX] - 1)]  # a gap in indices: no ITL for that token
    return recv[[col.REQUEST_ID, col.TOKEN_INDEX, CLIENT_NS]].reset_index(drop=True)


def _stage_sums(spans: pa.Table | None, requests: pa.Table, tokens: pa.Table,
                instances: pa.Table) -> pd.DataFrame | None:
    """Per server token: its stage time, each span clipped to the token's interval (as the breakdown does)."""
    if spans is None or spans.num_rows == 0:
        return None
    from analyzers.source import Source
    from analyzers.stage_breakdown import token_spans

    src = Source.of_tables(spans=spans, requests=requests, tokens=tokens, instances=instances)
    c = col
    return src.df(f"""
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, SUM(ns)::BIGINT AS {STAGE_SUM_NS}
        FROM {token_spans(src)} GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
    """)


def _chunk_of(tokens: pa.Table, instances: pa.Table, server: pd.DataFrame) -> pd.Series:
    """Per row of ``server`` (request_id, token_index): the index of the token that closed its
    chunk (the next one a server process sent), or the token itself in a request nothing sent."""
    clients = client_instance_ids(instances)
    srv = _only(tokens, clients, False) if clients else tokens
    sent = srv.filter(pc.is_valid(srv.column(col.SENT_NS))).select([col.REQUEST_ID, col.TOKEN_INDEX]).to_pandas()
    if sent.empty:
        return server[col.TOKEN_INDEX]
    key = [col.REQUEST_ID, col.TOKEN_INDEX]
    closes = sent[key].astype("int64").drop_duplicates().assign(_closes=True)
    streamed = closes[col.REQUEST_ID].unique()
    flagged = server[key].astype("int64").merge(closes, on=key, how="left")  # a left merge keeps server's order
    closing = pd.Series(np.where(flagged["_closes"].notna().to_numpy(), server[col.TOKEN_INDEX].to_numpy(float),
                                 np.nan), index=server.index, dtype="float64")
    chunk = closing.groupby(server[col.REQUEST_ID]).bfill()  # the next token that went out
    plain = ~server[col.REQUEST_ID].isin(streamed)
    return chunk.where(~plain, server[col.TOKEN_INDEX].astype("float64"))


def _token_times(tokens: pa.Table, instances: pa.Table, clients: bool) -> pd.DataFrame:
    """(request_id, token_index, time) on the reference clock: the client's receipt, or the
    server's send (a chunk written to the stream)."""
    ids = client_instance_ids(instances)
    tok = RunClocks.from_instances(instances).align(tokens, TOKENS.name)
    tok = _only(tok, ids, clients) if ids else (tok if not clients else tok.slice(0, 0))
    column = col.RECV_NS if clients else col.SENT_NS
    df = tok.select([col.REQUEST_ID, col.TOKEN_INDEX, column]).to_pandas().rename(columns={column: _DELIVERED})
    df = df.dropna(subset=[_DELIVERED])
    return df.groupby([col.REQUEST_ID, col.TOKEN_INDEX], as_index=False)[_DELIVERED].min()


def _align_by_time(chunks: pd.DataFrame, tokens: pa.Table, instances: pa.Table, has_sums: bool) -> pd.DataFrame:
    """``chunks`` re-indexed as the client counts them, for streamed requests whose chunk counts
    differ (see the module docstring); other requests keep their positions. Only a send time
    bounds a receipt: an engine's emit may run ahead of the stream, so requests no server
    process streamed are aligned by position."""
    recv = _token_times(tokens, instances, clients=True)
    if recv.empty or chunks.empty:
        return chunks
    delivered = _token_times(tokens, instances, clients=False).rename(columns={col.TOKEN_INDEX: "chunk"})
    client_count = recv.groupby(col.REQUEST_ID)[col.TOKEN_INDEX].max() + 1
    server_count = chunks.groupby(col.REQUEST_ID).size()
    both = client_count.index.intersection(server_count.index).intersection(pd.Index(delivered[col.REQUEST_ID]))
    differ = set(both[(client_count[both] != server_count[both]).to_numpy()])
    if not differ:
        return chunks
    delivered["chunk"] = delivered["chunk"].astype("float64")
    moved = chunks[chunks[col.REQUEST_ID].isin(differ)].merge(delivered, on=[col.REQUEST_ID, "chunk"], how="left")
    rows = []
    recv_of = {rid: g.sort_values(col.TOKEN_INDEX) for rid, g in recv[recv[col.REQUEST_ID].isin(differ)]
               .groupby(col.REQUEST_ID)}
    for rid, server in moved.sort_values([col.REQUEST_ID, col.TOKEN_INDEX]).groupby(col.REQUEST_ID):
        times = server[_DELIVERED].to_numpy(dtype="float64")
        lat = server[SERVER_NS].to_numpy(dtype="float64")
        stage = (server[STAGE_SUM_NS].astype("Float64").to_numpy(dtype="float64", na_value=np.nan)
                 if has_sums else None)
        done = 0  # server chunks already given to earlier client chunks
        for index, t in zip(recv_of[rid][col.TOKEN_INDEX], recv_of[rid][_DELIVERED]):
            ok = np.nonzero(times[done:] <= t + CHUNK_TOLERANCE_NS)[0]
            if ok.size == 0:
                continue  # the server delivered nothing new by then: no comparison for this chunk
            last = done + int(ok[-1])
            row = {col.REQUEST_ID: rid, "chunk": float(times[last]), col.TOKEN_INDEX: int(index),
                   SERVER_NS: lat[done:last + 1].sum()}
            if stage is not None:
                part = stage[done:last + 1]
                row[STAGE_SUM_NS] = np.nan if np.isnan(part).all() else np.nansum(part)
            rows.append(row)
            done = last + 1
    kept = chunks[~chunks[col.REQUEST_ID].isin(differ)]
    if not rows:
        return kept
    return pd.concat([kept, pd.DataFrame(rows)], ignore_index=True)


def token_agreement(requests: pa.Table, tokens: pa.Table, instances: pa.Table,
                    spans: pa.Table | None = None) -> pd.DataFrame:
    """One row per chunk seen by both sides: request_id, token_index (the chunk's position in
    the stream, as the client counts it), client_ns, server_ns, diff_ns, server_stage_sum_ns
    and stage_diff_ns (nullable Int64 when spans are absent). A chunk is a token unless the
    server held tokens back (see the module docstring)."""
    client = client_token_times(requests, tokens, instances)
    server = token_intervals(requests, tokens, instances)[[col.REQUEST_ID, col.TOKEN_INDEX, LATENCY]]
    server = server.rename(columns={LATENCY: SERVER_NS})
    for df in (client, server):
        df[col.TOKEN_INDEX] = df[col.TOKEN_INDEX].astype("int64")
        df[col.REQUEST_ID] = df[col.REQUEST_ID].astype("int64")
    sums = _stage_sums(spans, requests, tokens, instances)
    if sums is not None:
        sums[col.TOKEN_INDEX] = sums[col.TOKEN_INDEX].astype("int64")
        server = server.merge(sums, on=[col.REQUEST_ID, col.TOKEN_INDEX], how="left")
    server["chunk"] = _chunk_of(tokens, instances, server)
    server = server.dropna(subset=["chunk"])  # tokens after the last chunk sent: never delivered
    by_chunk = server.groupby([col.REQUEST_ID, "chunk"])  # sorted by request, then chunk
    chunks = by_chunk[SERVER_NS].sum().reset_index()
    if sums is not None:  # a chunk none of whose tokens has a span has no stage sum (NaN, not 0)
        chunks[STAGE_SUM_NS] = by_chunk[STAGE_SUM_NS].sum(min_count=1).to_numpy()
    chunks[col.TOKEN_INDEX] = chunks.groupby(col.REQUEST_ID).cumcount().astype("int64")  # sorted by chunk
    chunks = _align_by_time(chunks, tokens, instances, sums is not None)
    out = client.merge(chunks.drop(columns="chunk"), on=[col.REQUEST_ID, col.TOKEN_INDEX], how="inner")
    out[SERVER_NS] = out[SERVER_NS].astype("int64")
    out[DIFF_NS] = out[SERVER_NS] - out[CLIENT_NS]
    if sums is not None:
        out[STAGE_SUM_NS] = out[STAGE_SUM_NS].astype("Int64")
    else:
        out[STAGE_SUM_NS] = pd.array([pd.NA] * len(out), dtype="Int64")
    out[STAGE_DIFF_NS] = out[STAGE_SUM_NS] - out[CLIENT_NS]
    return out.sort_values([col.REQUEST_ID, col.TOKEN_INDEX]).reset_index(drop=True)


def ttft_agreement(requests: pa.Table, tokens: pa.Table, instances: pa.Table,
                   spans: pa.Table | None = None) -> pd.DataFrame:
    """Per request (token 0 rows of :func:`token_agreement`): client vs server TTFT, ns."""
    df = token_agreement(requests, tokens, instances, spans)
    return df[df[col.TOKEN_INDEX] == 0].reset_index(drop=True)


def itl_agreement(requests: pa.Table, tokens: pa.Table, instances: pa.Table,
                  spans: pa.Table | None = None) -> pd.DataFrame:
    """Per token i >= 1 (rows of :func:`token_agreement`): client vs server ITL, ns."""
    df = token_agreement(requests, tokens, instances, spans)
    return df[df[col.TOKEN_INDEX] > 0].reset_index(drop=True)


def agreement_summary(requests: pa.Table, tokens: pa.Table, instances: pa.Table,
                      spans: pa.Table | None = None) -> pd.DataFrame:
    """Distribution of the differences, in ms: one row per metric.

    Metrics: ``ttft`` and ``itl`` (server timestamps - client), ``ttft_stages`` and
    ``itl_stages`` (server stage sums - client). Columns: metric, count, mean_ms,
    p50_ms, p99_ms, max_abs_ms (NaN where a metric has no samples).
    """
    df = token_agreement(requests, tokens, instances, spans)
    rows = []
    for name, column in _SUMMARY_METRICS:
        part = df[df[col.TOKEN_INDEX] == 0] if name.startswith("ttft") else df[df[col.TOKEN_INDEX] > 0]
        v = part[column].dropna().to_numpy(dtype=float) / 1e6
        rows.append({
            "metric": name, "count": int(v.size),
            "mean_ms": float(v.mean()) if v.size else float("nan"),
            "p50_ms": float(np.percentile(v, 50)) if v.size else float("nan"),
            "p99_ms": float(np.percentile(v, 99)) if v.size else float("nan"),
            "max_abs_ms": float(np.abs(v).max()) if v.size else float("nan"),
        })
    return pd.DataFrame(rows)
