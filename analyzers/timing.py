"""Per-request and per-token latency facts, server view, on the reference clock.

Shared by every analyzer. Client-role rows (the load generator's own view) are
excluded: they are the independent witness that the agreement analyzer compares
against, not part of the server's timeline.

Definitions (all ns on the run's reference clock):

* ``arrival``: earliest ``requests.arrival_ns`` of the request over server
  instances (the outermost process that saw it, e.g. the gateway).
* ``t_i``, when output token i was delivered: its earliest ``tokens.sent_ns``
  if any server instance streamed it, else its earliest ``tokens.emit_ns``.
* token interval: token 0 ``[arrival, t_0]``; token i ``(t_{i-1}, t_i]``.
* a token's instance and engine step: those of the row that emitted it first.
* a request's instance: the instance that emitted its token 0 (the engine
  that served it), else the lowest instance id among its request rows.

:func:`token_times` and :func:`request_table` materialize these once per
:class:`~analyzers.source.Source` as DuckDB temporary tables and return their
names; when the run has current derived facts (:mod:`analyzers.facts`) they return
views over those files instead (same columns, same rows). :func:`token_intervals` and
:func:`request_facts` are the same facts for small in-memory Arrow tables, as pandas.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from analyzers import facts
from analyzers.source import Source
from tokentrace.schema import col

__all__ = ["token_intervals", "request_facts", "token_times", "token_steps", "request_table", "run_bounds", "run_start",
           "TOKEN_START", "TOKEN_END", "LATENCY", "LAST_TOKEN", "TTFT_NS", "TPOT_NS", "E2E_NS"]

TOKEN_START = "token_start_ns"
"""Start of a token's interval (arrival for token 0, previous delivery otherwise), ns."""
TOKEN_END = "token_end_ns"
"""When the token was delivered (t_i), ns."""
LATENCY = "latency_ns"
"""TOKEN_END - TOKEN_START: TTFT for token 0, ITL otherwise, ns."""
LAST_TOKEN = "last_token_ns"
"""Delivery time of a request's last token, ns."""
TTFT_NS = "ttft_ns"
TPOT_NS = "tpot_ns"
E2E_NS = "e2e_ns"


def token_times(src: Source) -> str:
    """Name of the temp table with one row per delivered output token.

    Columns: request_id, token_index, token_start_ns, token_end_ns, latency_ns (and, when one server
    process recorded every token, ``repeated_token``: always false; read the named columns). A token ends when a server process sent it to its client; failing that, when
    the streaming process received it and held it back (no text yet: it went out
    with the next chunk); failing that, when the engine emitted it.
    """
    def build() -> str:
        derived = facts.derived_file(src, "token_times")
        if derived is not None:  # the run's derived facts, current for its part files: read in place
            src.cached(_ONE_ROW_PER_TOKEN, lambda: derived.extra.get(facts.ONE_ROW_PER_TOKEN) == "1")
            return facts.view(src, "token_times")
        # One server process recorded the tokens (a colocated engine): each token has one row (the schema's
        # contract), so the rows need no grouping per token. The window below checks that contract and any
        # repeated token falls back to the grouped query.
        if src.scalar(f"SELECT COUNT(DISTINCT {col.INSTANCE_ID}) FROM srv_tokens") == 1:
            src.execute(_one_row_per_token_sql())
            if not src.scalar(f"SELECT bool_or({_REPEATED}) FROM token_times"):
                src.cached(_ONE_ROW_PER_TOKEN, lambda: True)
                return "token_times"
        src.cached(_ONE_ROW_PER_TOKEN, lambda: False)
        src.execute(_grouped_sql())
        return "token_times"
    return src.cached("token_times", build)


_ONE_ROW_PER_TOKEN = facts.ONE_ROW_PER_TOKEN  # Source cache key: the server's token rows are one per token


def _one_row_per_token(src: Source) -> bool:
    """True when one server process recorded every token, once (checked while building :func:`token_times`)."""
    token_times(src)
    return bool(src.cached(_ONE_ROW_PER_TOKEN, lambda: False))


_REPEATED = "repeated_token"
"""Column of ``token_times`` built from one server process: true on a row whose token the previous row had."""


def _one_row_per_token_sql() -> str:
    """``token_times`` from rows that are one per token (no GROUP BY); ``repeated_token`` marks a broken contract."""
    c = col
    t_end = f"COALESCE(t.{c.SENT_NS}, t.{c.RECV_NS}, t.{c.EMIT_NS})"
    start = f"CASE WHEN {c.TOKEN_INDEX} = 0 THEN arrival ELSE prev_end END"
    return f"""
        CREATE OR REPLACE TEMP TABLE token_times AS
        WITH arrivals AS (
            SELECT {c.REQUEST_ID}, MIN({c.ARRIVAL_NS}) AS arrival FROM srv_requests GROUP BY {c.REQUEST_ID}
        ), ordered AS (
            SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, {t_end} AS t_end, a.arrival,
                   LAG({t_end}) OVER w AS prev_end, LAG(t.{c.TOKEN_INDEX}) OVER w AS prev_index
            FROM srv_tokens t JOIN arrivals a USING ({c.REQUEST_ID})
            WHERE {t_end} IS NOT NULL
            WINDOW w AS (PARTITION BY t.{c.REQUEST_ID} ORDER BY t.{c.TOKEN_INDEX})
        )
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, {start} AS {TOKEN_START}, t_end AS {TOKEN_END},
               t_end - {start} AS {LATENCY}, COALESCE(prev_index = {c.TOKEN_INDEX}, false) AS {_REPEATED}
        FROM ordered
        WHERE ({c.TOKEN_INDEX} = 0 AND arrival IS NOT NULL) OR ({c.TOKEN_INDEX} > 0 AND prev_end IS NOT NULL)
    """


def _grouped_sql() -> str:
    """``token_times`` from any rows: each token's times grouped over the processes that recorded it."""
    c = col
    return f"""
        CREATE OR REPLACE TEMP TABLE token_times AS
        WITH arrivals AS (
            SELECT {c.REQUEST_ID}, MIN({c.ARRIVAL_NS}) AS arrival FROM srv_requests GROUP BY {c.REQUEST_ID}
        ), ends AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX},
                   COALESCE(MIN({c.SENT_NS}), MIN({c.RECV_NS}), MIN({c.EMIT_NS})) AS t_end
            FROM srv_tokens GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        ), ordered AS (
            SELECT e.*, a.arrival,
                   LAG(e.t_end) OVER (PARTITION BY e.{c.REQUEST_ID} ORDER BY e.{c.TOKEN_INDEX}) AS prev_end
            FROM ends e JOIN arrivals a USING ({c.REQUEST_ID})
            WHERE e.t_end IS NOT NULL
        )
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX},
               CASE WHEN {c.TOKEN_INDEX} = 0 THEN arrival ELSE prev_end END AS {TOKEN_START},
               t_end AS {TOKEN_END},
               t_end - CASE WHEN {c.TOKEN_INDEX} = 0 THEN arrival ELSE prev_end END AS {LATENCY}
        FROM ordered
        WHERE ({c.TOKEN_INDEX} = 0 AND arrival IS NOT NULL) OR ({c.TOKEN_INDEX} > 0 AND prev_end IS NOT NULL)
    """


def token_steps(src: Source) -> str:
    """Name of the temp table: request_id, token_index, instance_id, engine_step of the row that emitted
    each token first (null step / instance when no server row has an emit time)."""
    def build() -> str:
        c = col
        derived = facts.view(src, "token_steps")
        if derived is not None:
            return derived
        if _one_row_per_token(src):  # one row per token already: nothing to choose between
            src.execute(f"""
            CREATE OR REPLACE TEMP TABLE token_steps AS
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, {c.INSTANCE_ID}, {c.STEP}
            FROM srv_tokens WHERE {c.EMIT_NS} IS NOT NULL
            """)
            return "token_steps"
        src.execute(f"""
        CREATE OR REPLACE TEMP TABLE token_steps AS
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, arg_min({c.INSTANCE_ID}, {c.EMIT_NS}) AS {c.INSTANCE_ID},
               arg_min({c.STEP}, {c.EMIT_NS}) AS {c.STEP}
        FROM srv_tokens WHERE {c.EMIT_NS} IS NOT NULL GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        """)
        return "token_steps"
    return src.cached("token_steps", build)


def request_table(src: Source) -> str:
    """Name of the temp table with one row per request (server view).

    Columns: request_id, request_key, tenant_name, slo_class_name, arrival_ns,
    finish_ns, request_status, num_prompt_tokens, num_cached_tokens,
    first_token_ns, last_token_ns, num_output_tokens (tokens delivered),
    instance_id, ttft_ns, tpot_ns (null unless > 1 token), e2e_ns (finish, else
    last token, minus arrival; null without a first token).

    ``first_token_ns`` is when the first chunk with visible text went out, when a
    server process recorded it (``requests.first_content_ns``: the gateway), else
    when the first token was delivered; TTFT and TPOT count from it. That is the
    TTFT of AIPerf and ``vllm bench``: a chunk without text (a role-only chunk, or
    a token that completes no character) does not end it.
    """
    def build() -> str:
        c = col
        derived = facts.view(src, "request_facts")
        if derived is not None:
            return derived
        tt, ts = token_times(src), token_steps(src)
        src.execute(f"""
        CREATE OR REPLACE TEMP TABLE request_facts AS
        WITH r AS (
            SELECT {c.REQUEST_ID}, MAX({c.REQUEST_KEY}) AS {c.REQUEST_KEY},
                   COALESCE(MAX({c.TENANT}), '') AS {c.TENANT}, COALESCE(MAX({c.SLO_CLASS}), '') AS {c.SLO_CLASS},
                   MIN({c.ARRIVAL_NS}) AS {c.ARRIVAL_NS}, MAX({c.FINISH_NS}) AS {c.FINISH_NS},
                   MAX({c.STATUS}) AS {c.STATUS}, MAX({c.NUM_PROMPT_TOKENS}) AS {c.NUM_PROMPT_TOKENS},
                   MAX({c.NUM_CACHED_TOKENS}) AS {c.NUM_CACHED_TOKENS}, MIN({c.INSTANCE_ID}) AS req_instance,
                   MIN({c.FIRST_CONTENT_NS}) AS first_content
            FROM srv_requests GROUP BY {c.REQUEST_ID}
        ), d AS (
            SELECT {c.REQUEST_ID}, MIN({TOKEN_END}) AS first_delivered, MAX({TOKEN_END}) AS {LAST_TOKEN},
                   COUNT(*) AS {c.NUM_OUTPUT_TOKENS}
            FROM {tt} GROUP BY {c.REQUEST_ID}
        ), t AS (
            SELECT d.{c.REQUEST_ID}, d.{LAST_TOKEN}, d.{c.NUM_OUTPUT_TOKENS},
                   CASE WHEN r.first_content IS NULL THEN d.first_delivered  -- (LEAST skips nulls)
                        ELSE LEAST(r.first_content, d.{LAST_TOKEN}) END AS {c.FIRST_TOKEN_NS}
            FROM d LEFT JOIN r USING ({c.REQUEST_ID})
        ), i AS (
            SELECT {c.REQUEST_ID}, arg_min({c.INSTANCE_ID}, {c.TOKEN_INDEX}) AS tok_instance
            FROM {ts} GROUP BY {c.REQUEST_ID}
        )
        SELECT r.* EXCLUDE (req_instance, first_content), t.{c.FIRST_TOKEN_NS}, t.{LAST_TOKEN},
               COALESCE(t.{c.NUM_OUTPUT_TOKENS}, 0) AS {c.NUM_OUTPUT_TOKENS},
               COALESCE(i.tok_instance, r.req_instance) AS {c.INSTANCE_ID},
               t.{c.FIRST_TOKEN_NS} - r.{c.ARRIVAL_NS} AS {TTFT_NS},
               CASE WHEN t.{c.NUM_OUTPUT_TOKENS} > 1
                    THEN (t.{LAST_TOKEN} - t.{c.FIRST_TOKEN_NS}) / (t.{c.NUM_OUTPUT_TOKENS} - 1) END AS {TPOT_NS},
               CASE WHEN t.{c.FIRST_TOKEN_NS} IS NOT NULL
                    THEN COALESCE(r.{c.FINISH_NS}, t.{LAST_TOKEN}) - r.{c.ARRIVAL_NS} END AS {E2E_NS}
        FROM r LEFT JOIN t USING ({c.REQUEST_ID}) LEFT JOIN i USING ({c.REQUEST_ID})
        """)
        return "request_facts"
    return src.cached("request_facts", build)


def run_bounds(src: Source) -> tuple[int, int] | None:
    """(start, end) of the run on the reference clock, ns: first arrival to last finish or token.

    ``None`` when no request has an arrival time.

    The same figures as over the per-request facts (:func:`request_table`: first arrival, latest finish or
    last token), read from the requests' rows and :func:`token_times` so that the facts need not be built.
    """
    c = col
    row = src.fetchone(f"""
        SELECT (SELECT MIN({c.ARRIVAL_NS}) FROM srv_requests),
               GREATEST((SELECT MAX({c.FINISH_NS}) FROM srv_requests), (SELECT MAX({TOKEN_END}) FROM {token_times(src)}))
    """)
    if row is None or row[0] is None or row[1] is None:
        return None
    return int(row[0]), int(row[1])


def run_start(src: Source) -> int | None:
    """``run_bounds(src)[0]`` (None when ``run_bounds`` is None), without the token times when the requests'
    own rows show the run has an end (some request has a finish time): then the start is just the first
    server-side arrival."""
    c = col
    row = src.fetchone(f"SELECT MIN({c.ARRIVAL_NS}), MAX({c.FINISH_NS}) FROM srv_requests")
    if row is not None and row[0] is not None and row[1] is not None:
        return int(row[0])
    bounds = run_bounds(src)  # no finish recorded: the end is the last token (needs the token times)
    return None if bounds is None else bounds[0]


def token_intervals(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """One row per output token: request_id, token_index, token_start_ns, token_end_ns, latency_ns."""
    src = Source.of_tables(requests=requests, tokens=tokens, instances=instances)
    c = col
    return src.df(f"SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, {TOKEN_START}, {TOKEN_END}, {LATENCY} "
                  f"FROM {token_times(src)} ORDER BY {c.REQUEST_ID}, {c.TOKEN_INDEX}")


def request_facts(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """One row per request (columns as :func:`request_table`), ordered by arrival."""
    src = Source.of_tables(requests=requests, tokens=tokens, instances=instances)
    return src.df(f"SELECT * FROM {request_table(src)} ORDER BY {col.ARRIVAL_NS}")
