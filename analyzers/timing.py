"""Per-request and per-token latency facts, server view, on the reference clock.

Shared by the latency and stage-breakdown analyzers. Inputs are store tables
(Arrow); the result tables are pandas DataFrames. Client-role rows (the load
generator's own view) are excluded: they are the independent witness that the
agreement analyzer compares against, not part of the server's timeline.

Definitions (all ns on the run's reference clock):

* ``arrival``: earliest ``requests.arrival_ns`` of the request over server
  instances (the outermost process that saw it, e.g. the gateway).
* ``t_i``, when output token i was delivered: its earliest ``tokens.sent_ns``
  if any server instance streamed it, else its earliest ``tokens.emit_ns``.
* token interval: token 0 ``[arrival, t_0]``; token i ``(t_{i-1}, t_i]``.
"""

from __future__ import annotations

import duckdb
import pandas as pd
import pyarrow as pa

from analyzers.align import align, client_instance_ids
from tokentrace.schema import REQUESTS, TOKENS, col

__all__ = ["token_intervals", "request_facts", "connect"]

TOKEN_START = "token_start_ns"
TOKEN_END = "token_end_ns"
LATENCY = "latency_ns"


def connect(**tables: pa.Table) -> duckdb.DuckDBPyConnection:
    """A private DuckDB connection with the given Arrow tables registered as views."""
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con


def _server_only(t: pa.Table, instances: pa.Table) -> pa.Table:
    clients = client_instance_ids(instances)
    if not clients or t.num_rows == 0:
        return t
    import pyarrow.compute as pc

    mask = pc.invert(pc.is_in(t.column(col.INSTANCE_ID), value_set=pa.array(clients, pa.int64())))
    return t.filter(mask)


def token_intervals(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """One row per output token: request_id, token_index, token_start_ns, token_end_ns, latency_ns."""
    req = _server_only(align(requests, REQUESTS.name, instances), instances)
    tok = _server_only(align(tokens, TOKENS.name, instances), instances)
    con = connect(req=req, tok=tok)
    c = col
    sql = f"""
    WITH arrivals AS (
        SELECT {c.REQUEST_ID}, MIN({c.ARRIVAL_NS}) AS arrival FROM req GROUP BY {c.REQUEST_ID}
    ), ends AS (
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX},
               COALESCE(MIN({c.SENT_NS}), MIN({c.EMIT_NS})) AS t_end
        FROM tok GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
    ), ordered AS (
        SELECT e.{c.REQUEST_ID}, e.{c.TOKEN_INDEX}, e.t_end,
               LAG(e.t_end) OVER (PARTITION BY e.{c.REQUEST_ID} ORDER BY e.{c.TOKEN_INDEX}) AS prev_end,
               a.arrival
        FROM ends e JOIN arrivals a USING ({c.REQUEST_ID})
        WHERE e.t_end IS NOT NULL
    )
    SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX},
           CASE WHEN {c.TOKEN_INDEX} = 0 THEN arrival ELSE prev_end END AS {TOKEN_START},
           t_end AS {TOKEN_END},
           t_end - CASE WHEN {c.TOKEN_INDEX} = 0 THEN arrival ELSE prev_end END AS {LATENCY}
    FROM ordered
    WHERE {c.TOKEN_INDEX} = 0 OR prev_end IS NOT NULL
    ORDER BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
    """
    return con.execute(sql).df()


def request_facts(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """One row per request: ids, tenant, class, arrival, first token, last token, finish, counts.

    Columns: request_id, tenant_name, slo_class_name, arrival_ns, first_token_ns,
    last_token_ns, finish_ns, num_output_tokens (tokens delivered), status.
    """
    req = _server_only(align(requests, REQUESTS.name, instances), instances)
    ti = token_intervals(requests, tokens, instances)
    con = connect(req=req)
    con.register("ti", ti)
    c = col
    sql = f"""
    WITH r AS (
        SELECT {c.REQUEST_ID},
               MAX({c.TENANT}) AS {c.TENANT}, MAX({c.SLO_CLASS}) AS {c.SLO_CLASS},
               MIN({c.ARRIVAL_NS}) AS {c.ARRIVAL_NS}, MAX({c.FINISH_NS}) AS {c.FINISH_NS},
               MAX({c.STATUS}) AS {c.STATUS}, MAX({c.NUM_PROMPT_TOKENS}) AS {c.NUM_PROMPT_TOKENS},
               MAX({c.NUM_CACHED_TOKENS}) AS {c.NUM_CACHED_TOKENS}
        FROM req GROUP BY {c.REQUEST_ID}
    ), t AS (
        SELECT {c.REQUEST_ID}, MIN({TOKEN_END}) AS {c.FIRST_TOKEN_NS}, MAX({TOKEN_END}) AS last_token_ns,
               COUNT(*) AS {c.NUM_OUTPUT_TOKENS}
        FROM ti GROUP BY {c.REQUEST_ID}
    )
    SELECT r.*, t.{c.FIRST_TOKEN_NS}, t.last_token_ns, COALESCE(t.{c.NUM_OUTPUT_TOKENS}, 0) AS {c.NUM_OUTPUT_TOKENS}
    FROM r LEFT JOIN t USING ({c.REQUEST_ID})
    ORDER BY {c.ARRIVAL_NS}
    """
    return con.execute(sql).df()
