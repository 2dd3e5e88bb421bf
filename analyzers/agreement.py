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

A run's :class:`~analyzers.source.Source` in (:func:`source_token_agreement`, which
:meth:`analyzers.analysis.RunAnalysis.agreement` calls: the joins and groupings run in its
engine, over the part files or the run's derived facts), or store tables (Arrow) in; pandas out.
No client rows or no server rows give empty results.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from analyzers.source import Source, client_instance_ids
from analyzers.timing import LATENCY, token_times
from tokentrace.schema import col

__all__ = ["client_token_times", "token_agreement", "ttft_agreement", "itl_agreement", "agreement_summary",
           "source_token_agreement", "source_agreement_summary", "CLIENT_NS", "SERVER_NS", "STAGE_SUM_NS", "DIFF_NS",
           "STAGE_DIFF_NS", "CHUNK_TOLERANCE_NS"]

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
_SUMMARY_METRICS = (("ttft", DIFF_NS), ("itl", DIFF_NS), ("itl_stages", STAGE_DIFF_NS))
"""The summary's rows. No ``ttft_stages``: token 0's stages tile [arrival, first token delivered], so their sum is
the server's TTFT by construction and the row would repeat ``ttft`` without checking anything."""


def _clients(src: Source) -> str:
    """SQL list of the client instances' ids (``NULL`` when there is none: ``IN (NULL)`` keeps no row)."""
    ids = client_instance_ids(src.arrow("SELECT * FROM instances"))
    return ", ".join(str(int(i)) for i in ids) or "NULL"


def _client_sql(clients: str) -> str:
    """SELECT of the client's view per token: request_id, token_index, client_ns (TTFT for token 0, else the
    gap since the previous chunk; none after a gap in indices, nor for a request the client never sent)."""
    c = col
    return f"""
        WITH sends AS (
            SELECT {c.REQUEST_ID}, MIN({c.ARRIVAL_NS}) AS send_ns FROM requests
            WHERE {c.INSTANCE_ID} IN ({clients}) AND {c.ARRIVAL_NS} IS NOT NULL GROUP BY {c.REQUEST_ID}
        ), recv AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, MIN({c.RECV_NS}) AS recv_ns FROM tokens
            WHERE {c.INSTANCE_ID} IN ({clients}) AND {c.RECV_NS} IS NOT NULL GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        ), ordered AS (
            SELECT r.{c.REQUEST_ID}, r.{c.TOKEN_INDEX}, r.recv_ns, s.send_ns,
                   LAG(r.recv_ns) OVER w AS prev_ns, LAG(r.{c.TOKEN_INDEX}) OVER w AS prev_index
            FROM recv r JOIN sends s ON r.{c.REQUEST_ID} = s.{c.REQUEST_ID}
            WINDOW w AS (PARTITION BY r.{c.REQUEST_ID} ORDER BY r.{c.TOKEN_INDEX})
        )
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX},
               CASE WHEN {c.TOKEN_INDEX} = 0 THEN recv_ns - send_ns ELSE recv_ns - prev_ns END AS {CLIENT_NS}
        FROM ordered WHERE {c.TOKEN_INDEX} = 0 OR prev_index = {c.TOKEN_INDEX} - 1
    """


def _chunks(src: Source) -> None:
    """Temp table ``agr_chunks``: the server's chunks, request_id, chunk (the index of the token that closed
    it), chunk_index (its position in the stream), server_ns and server_stage_sum_ns (NULL: no span).

    A token goes out with the next token a server process sent (``sent_ns``), itself included; in a request
    nothing was sent for (an engine alone), every token is its own chunk; tokens after the last one sent were
    never delivered. Each token's latency and in-interval stage time (:func:`~analyzers.stage_breakdown.
    token_spans`) add up into its chunk."""
    from analyzers.stage_breakdown import token_spans

    c = col
    src.execute(f"""
        CREATE OR REPLACE TEMP TABLE agr_chunks AS
        WITH closes AS (
            SELECT DISTINCT {c.REQUEST_ID}, {c.TOKEN_INDEX} FROM srv_tokens WHERE {c.SENT_NS} IS NOT NULL
        ), streamed AS (SELECT DISTINCT {c.REQUEST_ID} FROM closes),
        stage AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, SUM(ns) AS stage_ns FROM {token_spans(src)}
            GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        ), server AS (
            SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{LATENCY} AS lat, g.stage_ns,
                   CASE WHEN s.{c.REQUEST_ID} IS NULL THEN t.{c.TOKEN_INDEX}
                        ELSE MIN(k.{c.TOKEN_INDEX}) OVER (PARTITION BY t.{c.REQUEST_ID} ORDER BY t.{c.TOKEN_INDEX}
                                                      ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) END AS chunk
            FROM {token_times(src)} t
            LEFT JOIN closes k ON t.{c.REQUEST_ID} = k.{c.REQUEST_ID} AND t.{c.TOKEN_INDEX} = k.{c.TOKEN_INDEX}
            LEFT JOIN streamed s ON t.{c.REQUEST_ID} = s.{c.REQUEST_ID}
            LEFT JOIN stage g ON t.{c.REQUEST_ID} = g.{c.REQUEST_ID} AND t.{c.TOKEN_INDEX} = g.{c.TOKEN_INDEX}
        ), grouped AS (
            SELECT {c.REQUEST_ID}, chunk, SUM(lat) AS {SERVER_NS}, SUM(stage_ns) AS {STAGE_SUM_NS}
            FROM server WHERE chunk IS NOT NULL GROUP BY {c.REQUEST_ID}, chunk
        )
        SELECT *, ROW_NUMBER() OVER (PARTITION BY {c.REQUEST_ID} ORDER BY chunk) - 1 AS chunk_index FROM grouped
    """)


def _realigned(src: Source, clients: str) -> pd.DataFrame:
    """The chunks of the streamed requests whose chunk counts differ between the two sides, re-indexed as the
    client counts them (see the module docstring): request_id, chunk_index, server_ns, server_stage_sum_ns.
    Only a send time bounds a receipt (an engine's emit may run ahead of the stream), so requests no server
    process streamed keep their positions. Few requests differ; they are aligned one by one."""
    c = col
    differ = f"""
        WITH recv AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, MIN({c.RECV_NS}) AS t FROM tokens
            WHERE {c.INSTANCE_ID} IN ({clients}) AND {c.RECV_NS} IS NOT NULL GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        ), client_count AS (SELECT {c.REQUEST_ID}, MAX({c.TOKEN_INDEX}) + 1 AS n FROM recv GROUP BY {c.REQUEST_ID}),
        server_count AS (SELECT {c.REQUEST_ID}, COUNT(*) AS n FROM agr_chunks GROUP BY {c.REQUEST_ID}),
        delivered AS (SELECT DISTINCT {c.REQUEST_ID} FROM srv_tokens WHERE {c.SENT_NS} IS NOT NULL)
        SELECT a.{c.REQUEST_ID} FROM client_count a
        JOIN server_count b ON a.{c.REQUEST_ID} = b.{c.REQUEST_ID}
        JOIN delivered d ON a.{c.REQUEST_ID} = d.{c.REQUEST_ID}
        WHERE a.n <> b.n
    """
    moved = src.df(f"""
        WITH differ AS ({differ}),
        sent AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, MIN({c.SENT_NS}) AS {_DELIVERED} FROM srv_tokens
            WHERE {c.SENT_NS} IS NOT NULL AND {c.REQUEST_ID} IN (SELECT {c.REQUEST_ID} FROM differ)
            GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        )
        SELECT k.{c.REQUEST_ID}, k.chunk_index, k.{SERVER_NS}, k.{STAGE_SUM_NS}, s.{_DELIVERED}
        FROM agr_chunks k JOIN differ USING ({c.REQUEST_ID})
        LEFT JOIN sent s ON k.{c.REQUEST_ID} = s.{c.REQUEST_ID} AND k.chunk = s.{c.TOKEN_INDEX}
        ORDER BY k.{c.REQUEST_ID}, k.chunk_index
    """)
    if moved.empty:
        return moved
    recv = src.df(f"""
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, MIN({c.RECV_NS}) AS {_DELIVERED} FROM tokens
        WHERE {c.INSTANCE_ID} IN ({clients}) AND {c.RECV_NS} IS NOT NULL
          AND {c.REQUEST_ID} IN (SELECT {c.REQUEST_ID} FROM ({differ}) d)
        GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX} ORDER BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
    """)
    recv_of = {rid: g for rid, g in recv.groupby(c.REQUEST_ID, sort=False)}
    rows = []
    for rid, server in moved.groupby(c.REQUEST_ID, sort=False):
        times = server[_DELIVERED].to_numpy(dtype="float64", na_value=np.nan)
        lat = server[SERVER_NS].to_numpy(dtype="float64")
        stage = server[STAGE_SUM_NS].to_numpy(dtype="float64", na_value=np.nan)
        done = 0  # server chunks already given to earlier client chunks
        client = recv_of.get(rid)
        for index, t in zip(client[c.TOKEN_INDEX], client[_DELIVERED]) if client is not None else ():
            ok = np.nonzero(times[done:] <= t + CHUNK_TOLERANCE_NS)[0]
            if ok.size == 0:
                continue  # the server delivered nothing new by then: no comparison for this chunk
            last = done + int(ok[-1])
            part = stage[done:last + 1]
            rows.append({c.REQUEST_ID: rid, "chunk_index": int(index), SERVER_NS: lat[done:last + 1].sum(),
                         STAGE_SUM_NS: np.nan if np.isnan(part).all() else np.nansum(part)})
            done = last + 1
    return pd.DataFrame(rows, columns=[c.REQUEST_ID, "chunk_index", SERVER_NS, STAGE_SUM_NS])


def source_token_agreement(src: Source) -> pd.DataFrame:
    """:func:`token_agreement` of a :class:`~analyzers.source.Source` (any engine, the run's derived facts when
    it has them): the joins and groupings run in the engine, only the compared chunks come back."""
    c = col
    clients = _clients(src)
    _chunks(src)
    realigned = _realigned(src, clients)
    moved = "" if realigned.empty else "agr_moved"
    if moved:
        src.register(moved, realigned)
    kept = (f"SELECT {c.REQUEST_ID}, chunk_index, {SERVER_NS}, {STAGE_SUM_NS} FROM agr_chunks"
            + (f" WHERE {c.REQUEST_ID} NOT IN (SELECT DISTINCT {c.REQUEST_ID} FROM {moved})" if moved else "")
            + (f" UNION ALL SELECT {c.REQUEST_ID}, chunk_index, {SERVER_NS}, {STAGE_SUM_NS} FROM {moved}"
               if moved else ""))
    out = src.df(f"""
        WITH client AS ({_client_sql(clients)}), server AS ({kept})
        SELECT k.{c.REQUEST_ID}, k.{c.TOKEN_INDEX}, k.{CLIENT_NS}, CAST(s.{SERVER_NS} AS BIGINT) AS {SERVER_NS},
               CAST(s.{STAGE_SUM_NS} AS BIGINT) AS {STAGE_SUM_NS}
        FROM client k JOIN server s ON k.{c.REQUEST_ID} = s.{c.REQUEST_ID} AND k.{c.TOKEN_INDEX} = s.chunk_index
        ORDER BY k.{c.REQUEST_ID}, k.{c.TOKEN_INDEX}
    """)
    if moved:
        src.unregister(moved)
    src.execute("DROP TABLE IF EXISTS agr_chunks")
    for name in (c.REQUEST_ID, c.TOKEN_INDEX, CLIENT_NS, SERVER_NS):
        out[name] = out[name].astype("int64")
    out[DIFF_NS] = out[SERVER_NS] - out[CLIENT_NS]
    out[STAGE_SUM_NS] = out[STAGE_SUM_NS].astype("Int64")
    out[STAGE_DIFF_NS] = out[STAGE_SUM_NS] - out[CLIENT_NS]
    return out[[c.REQUEST_ID, c.TOKEN_INDEX, CLIENT_NS, SERVER_NS, DIFF_NS, STAGE_SUM_NS, STAGE_DIFF_NS]]


def source_agreement_summary(src: Source) -> pd.DataFrame:
    """:func:`agreement_summary` of a :class:`~analyzers.source.Source`."""
    return _summary(source_token_agreement(src))


def _tables(requests: pa.Table, tokens: pa.Table, instances: pa.Table, spans: pa.Table | None) -> Source:
    return Source.of_tables(requests=requests, tokens=tokens, instances=instances, spans=spans)


def client_token_times(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """Client view per token: request_id, token_index, client_ns (TTFT for token 0, else ITL).

    Tokens of requests the client never saw a token 0 of are left out.
    """
    src = _tables(requests, tokens, instances, None)
    c = col
    out = src.df(f"SELECT * FROM ({_client_sql(_clients(src))}) x ORDER BY {c.REQUEST_ID}, {c.TOKEN_INDEX}")
    return out.astype({c.REQUEST_ID: "int64", c.TOKEN_INDEX: "int64", CLIENT_NS: "int64"})


def token_agreement(requests: pa.Table, tokens: pa.Table, instances: pa.Table,
                    spans: pa.Table | None = None) -> pd.DataFrame:
    """One row per chunk seen by both sides: request_id, token_index (the chunk's position in
    the stream, as the client counts it), client_ns, server_ns, diff_ns, server_stage_sum_ns
    and stage_diff_ns (nullable Int64, null without spans). A chunk is a token unless the
    server held tokens back (see the module docstring)."""
    return source_token_agreement(_tables(requests, tokens, instances, spans))


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

    Metrics: ``ttft`` and ``itl`` (server timestamps - client) and ``itl_stages`` (server
    stage sums - client). Columns: metric, count, mean_ms and p50_ms (signed: the bias),
    p50_abs_ms, p99_abs_ms and max_abs_ms (percentiles of the absolute difference: the
    tail, whichever side it is on; a signed p99 of a difference that is normally negative
    would be its harmless end), and max_ms (the largest signed difference: above zero, the
    server saw a token later than the client). NaN where a metric has no samples.
    """
    return _summary(token_agreement(requests, tokens, instances, spans))


def _summary(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for name, column in _SUMMARY_METRICS:
        part = df[df[col.TOKEN_INDEX] == 0] if name.startswith("ttft") else df[df[col.TOKEN_INDEX] > 0]
        v = part[column].dropna().to_numpy(dtype=float) / 1e6
        rows.append({
            "metric": name, "count": int(v.size),
            "mean_ms": float(v.mean()) if v.size else float("nan"),
            "p50_ms": float(np.percentile(v, 50)) if v.size else float("nan"),
            "p50_abs_ms": float(np.percentile(np.abs(v), 50)) if v.size else float("nan"),
            "p99_abs_ms": float(np.percentile(np.abs(v), 99)) if v.size else float("nan"),
            "max_abs_ms": float(np.abs(v).max()) if v.size else float("nan"),
            "max_ms": float(v.max()) if v.size else float("nan"),
        })
    return pd.DataFrame(rows)
