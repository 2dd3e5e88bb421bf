"""Per-request and per-token latency facts, server view, on the reference clock.

Shared by every analyzer. Client-role rows (the load generator's own view) are
excluded: they are the independent witness that the agreement analyzer compares
against, not part of the server's timeline.

Definitions (all ns on the run's reference clock):

* ``arrival``: earliest ``requests.arrival_ns`` of the request over server
  instances (the outermost process that saw it, e.g. the gateway).
* ``t_i``, when output token i was delivered: its earliest ``tokens.sent_ns``
  if any server instance streamed it, else its earliest ``tokens.recv_ns`` (the
  streaming process held it back: no text yet), else its earliest ``tokens.emit_ns``.
* ``F``, the first visible content: the request's ``first_content_ns`` (the first
  chunk with text, earliest over server rows), else its first token sent to a
  client, else its first delivery; never after its last delivery. TTFT is
  ``F - arrival`` in every analysis: what AIPerf, ``vllm bench`` and the latency
  table count.
* token interval: token 0 ``[arrival, F]``; token i ``(max(t_{i-1}, F), max(t_i, F)]``.
  A token delivered by ``F`` (held back and sent with the first content) has an
  empty interval: its time is part of TTFT.
* own interval (what a token's spans are clipped to, :mod:`analyzers.stage_breakdown`):
  token 0 ``[arrival, t_0]``, token i ``(t_{i-1}, t_i]``; a token delivered by ``F``
  counts its span time in token 0 (``counted_in_token``), so token 0's stages tile
  ``[arrival, F]``.
* a token's instance and engine step: those of the row that emitted it first.
* a request's instance: the instance that emitted its token 0 (the engine
  that served it), else the lowest instance id among its request rows.

:func:`token_times`, :func:`token_steps` and :func:`request_table` return the
relations of the derived facts :data:`TOKEN_TIMES`, :data:`TOKEN_STEPS` and
:data:`REQUEST_FACTS` (:func:`analyzers.facts.relation`: the run's saved copy, or
built once per :class:`~analyzers.source.Source`). :func:`token_intervals` and
:func:`request_facts` are the same facts for small in-memory Arrow tables, as pandas.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from analyzers import facts
from analyzers.source import Source
from tokentrace.schema import REQUESTS, TOKENS, col

__all__ = ["TOKEN_TIMES", "TOKEN_STEPS", "REQUEST_FACTS", "token_intervals", "request_facts", "token_times",
           "token_steps", "request_table", "run_bounds", "run_start", "TOKEN_START", "TOKEN_END", "LATENCY",
           "OWN_START", "OWN_END", "COUNTED_IN", "LAST_TOKEN", "TTFT_NS", "TPOT_NS", "E2E_NS"]

TOKEN_START = "token_start_ns"
"""Start of a token's interval (arrival for token 0, the previous token's end otherwise), ns."""
TOKEN_END = "token_end_ns"
"""End of a token's interval: the first visible content for token 0, else its delivery (never before the first
visible content), ns."""
LATENCY = "latency_ns"
"""TOKEN_END - TOKEN_START: TTFT for token 0, ITL otherwise, ns."""
OWN_START = "own_start_ns"
"""Start of the span of time the token's own spans are clipped to: arrival for token 0, else the previous token's
own delivery, ns."""
OWN_END = "own_end_ns"
"""The token's own delivery (t_i), ns."""
COUNTED_IN = "counted_in_token"
"""The token whose interval the token's span time counts in: 0 for a token delivered by the first visible content
(held back with it), else the token itself."""
LAST_TOKEN = "last_token_ns"
"""Delivery time of a request's last token, ns."""
TTFT_NS = "ttft_ns"
TPOT_NS = "tpot_ns"
E2E_NS = "e2e_ns"


def token_times(src: Source) -> str:
    """Relation of :data:`TOKEN_TIMES`: one row per delivered output token (request_id, token_index,
    token_start_ns, token_end_ns, latency_ns).

    A token ends when a server process sent it to its client; failing that, when the streaming process received
    it and held it back (no text yet: it went out with the next chunk); failing that, when the engine emitted it.
    """
    return facts.relation(src, TOKEN_TIMES)


def _build_token_times(src: Source, table: str) -> None:
    """Materialize :data:`TOKEN_TIMES` as ``table``."""
    # One server process recorded the tokens (a colocated engine): each token has one row (the schema's
    # contract), so the rows need no grouping per token. The window below checks that contract and any
    # repeated token falls back to the grouped query.
    if src.scalar(f"SELECT COUNT(DISTINCT {col.INSTANCE_ID}) FROM srv_tokens") == 1:
        src.execute(_one_row_per_token_sql(table))
        if not src.scalar(f"SELECT bool_or({_REPEATED}) FROM {table}"):
            src.cached(_ONE_ROW_PER_TOKEN, lambda: True)
            return
    src.cached(_ONE_ROW_PER_TOKEN, lambda: False)
    src.execute(_grouped_sql(table))


_ONE_ROW_PER_TOKEN = "one_row_per_token"  # Source cache key: the server's token rows are one per token


def _one_row_per_token(src: Source) -> bool:
    """True when one server process recorded every token, once (known when :data:`TOKEN_TIMES` was built for this
    source; False when it was read from the run's saved facts: then the general query is used)."""
    token_times(src)
    return bool(src.cached(_ONE_ROW_PER_TOKEN, lambda: False))


_REPEATED = "repeated_token"
"""Column of ``token_times`` built from one server process: true on a row whose token the previous row had."""


def _one_row_per_token_sql(table: str) -> str:
    """``token_times`` from rows that are one per token (no GROUP BY); ``repeated_token`` marks a broken contract."""
    c = col
    t_end = f"COALESCE(t.{c.SENT_NS}, t.{c.RECV_NS}, t.{c.EMIT_NS})"
    return f"""
        CREATE OR REPLACE TEMP TABLE {table} AS
        WITH arrivals AS ({_arrivals_sql("srv_tokens t", t_end, f"t.{c.SENT_NS}")}), ordered AS (
            SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, {t_end} AS t_end, a.arrival, a.first_visible,
                   LAG({t_end}) OVER w AS prev_end, LAG(t.{c.TOKEN_INDEX}) OVER w AS prev_index
            FROM srv_tokens t JOIN arrivals a USING ({c.REQUEST_ID})
            WHERE {t_end} IS NOT NULL
            WINDOW w AS (PARTITION BY t.{c.REQUEST_ID} ORDER BY t.{c.TOKEN_INDEX})
        )
        {_intervals_sql("COALESCE(prev_index = " + c.TOKEN_INDEX + ", false) AS " + _REPEATED)}
    """


def _grouped_sql(table: str) -> str:
    """``token_times`` from any rows: each token's times grouped over the processes that recorded it."""
    c = col
    return f"""
        CREATE OR REPLACE TEMP TABLE {table} AS
        WITH ends AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, MIN({c.SENT_NS}) AS sent,
                   COALESCE(MIN({c.SENT_NS}), MIN({c.RECV_NS}), MIN({c.EMIT_NS})) AS t_end
            FROM srv_tokens GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        ), arrivals AS ({_arrivals_sql("ends e", "e.t_end", "e.sent")}), ordered AS (
            SELECT e.{c.REQUEST_ID}, e.{c.TOKEN_INDEX}, e.t_end, a.arrival, a.first_visible,
                   LAG(e.t_end) OVER w AS prev_end, LAG(e.{c.TOKEN_INDEX}) OVER w AS prev_index
            FROM ends e JOIN arrivals a USING ({c.REQUEST_ID})
            WHERE e.t_end IS NOT NULL
            WINDOW w AS (PARTITION BY e.{c.REQUEST_ID} ORDER BY e.{c.TOKEN_INDEX})
        )
        {_intervals_sql()}
    """


def _arrivals_sql(tokens: str, t_end: str, sent: str) -> str:
    """Per request: its arrival (earliest over the server rows) and ``first_visible`` (``F`` of the module doc: its
    first visible content, else its first token sent, else its first delivery; never after its last delivery), from
    token rows ``tokens`` with delivery ``t_end`` and sent time ``sent``. One grouped pass over the token rows: no
    window aggregate over each request's rows beside the sort that orders them."""
    c = col
    return f"""
        SELECT r.{c.REQUEST_ID}, r.arrival,
               LEAST(COALESCE(r.first_content, d.first_sent, d.first_end), d.last_end) AS first_visible
        FROM (SELECT {c.REQUEST_ID}, MIN({c.ARRIVAL_NS}) AS arrival, MIN({c.FIRST_CONTENT_NS}) AS first_content
              FROM srv_requests GROUP BY {c.REQUEST_ID}) r
        LEFT JOIN (SELECT {c.REQUEST_ID}, MIN({sent}) AS first_sent, MIN({t_end}) AS first_end,
                          MAX({t_end}) AS last_end
                   FROM {tokens} GROUP BY {c.REQUEST_ID}) d USING ({c.REQUEST_ID})
    """


def _intervals_sql(extra: str = "") -> str:
    """The SELECT of ``token_times`` from CTE ``ordered`` (request_id, token_index, t_end: the token's own
    delivery, arrival, prev_end, prev_index, first_visible), as the module doc defines the intervals."""
    c = col
    first = "first_visible"
    return f"""
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX},
               CASE WHEN {c.TOKEN_INDEX} = 0 THEN arrival WHEN prev_index = 0 THEN {first}
                    ELSE GREATEST(prev_end, {first}) END AS {TOKEN_START},
               CASE WHEN {c.TOKEN_INDEX} = 0 THEN {first} ELSE GREATEST(t_end, {first}) END AS {TOKEN_END},
               CASE WHEN {c.TOKEN_INDEX} = 0 THEN {first} - arrival
                    ELSE GREATEST(t_end, {first})
                         - CASE WHEN prev_index = 0 THEN {first} ELSE GREATEST(prev_end, {first}) END END AS {LATENCY},
               CASE WHEN {c.TOKEN_INDEX} = 0 THEN arrival ELSE prev_end END AS {OWN_START},
               t_end AS {OWN_END},
               CASE WHEN {c.TOKEN_INDEX} > 0 AND t_end <= {first} THEN 0 ELSE {c.TOKEN_INDEX} END AS {COUNTED_IN}
               {", " + extra if extra else ""}
        FROM ordered
        WHERE ({c.TOKEN_INDEX} = 0 AND arrival IS NOT NULL) OR ({c.TOKEN_INDEX} > 0 AND prev_end IS NOT NULL)
    """


def token_steps(src: Source) -> str:
    """Relation of :data:`TOKEN_STEPS`: request_id, token_index, instance_id, engine_step of the row that emitted
    each token first (tokens no server row has an emit time for are left out)."""
    return facts.relation(src, TOKEN_STEPS)


def _token_steps_sql(src: Source) -> str:
    c = col
    if _one_row_per_token(src):  # one row per token already: nothing to choose between
        return (f"SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, {c.INSTANCE_ID}, {c.STEP} "
                f"FROM srv_tokens WHERE {c.EMIT_NS} IS NOT NULL")
    return f"""
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, arg_min({c.INSTANCE_ID}, {c.EMIT_NS}) AS {c.INSTANCE_ID},
               arg_min({c.STEP}, {c.EMIT_NS}) AS {c.STEP}
        FROM srv_tokens WHERE {c.EMIT_NS} IS NOT NULL GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
    """


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
    return facts.relation(src, REQUEST_FACTS)


def _request_facts_sql(src: Source) -> str:
    c = col
    tt, ts = token_times(src), token_steps(src)
    return f"""
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
    """


_REQ_ID = TOKENS.column(col.REQUEST_ID)
_TOKEN_INDEX = TOKENS.column(col.TOKEN_INDEX)

TOKEN_TIMES = facts.Fact(
    "token_times", "One row per delivered output token: its interval on the reference clock (module doc).",
    (_REQ_ID, _TOKEN_INDEX,
     facts.i64(TOKEN_START, "Start of the token's interval: the request's arrival for token 0, else the previous "
                            "token's delivery; ns, reference clock."),
     facts.i64(TOKEN_END, "When the token was delivered (t_i); ns, reference clock."),
     facts.i64(LATENCY, "token_end_ns - token_start_ns: TTFT for token 0, ITL otherwise; ns."),
     facts.i64(OWN_START, "Start of the time its own spans are clipped to: arrival for token 0, else the previous "
                          "token's delivery; ns, reference clock."),
     facts.i64(OWN_END, "The token's own delivery (t_i); ns, reference clock."),
     facts.i32(COUNTED_IN, "The token whose interval its span time counts in (0 when delivered by the first "
                           "visible content).")),
    build=_build_token_times)

TOKEN_STEPS = facts.Fact(
    "token_steps", "One row per token a server row has an emit time for: the instance and engine step of the row "
                   "that emitted it first.",
    (_REQ_ID, _TOKEN_INDEX, TOKENS.column(col.INSTANCE_ID), TOKENS.column(col.STEP)),
    select=_token_steps_sql)

REQUEST_FACTS = facts.Fact(
    "request_facts", "One row per request (server view): identity, grouping columns, times and counts "
                     "(:func:`request_table`).",
    (REQUESTS.column(col.REQUEST_ID), REQUESTS.column(col.REQUEST_KEY), REQUESTS.column(col.TENANT),
     REQUESTS.column(col.SLO_CLASS), REQUESTS.column(col.ARRIVAL_NS), REQUESTS.column(col.FINISH_NS),
     REQUESTS.column(col.STATUS), facts.i64(col.NUM_PROMPT_TOKENS, "Prompt tokens (most any server row saw)."),
     facts.i64(col.NUM_CACHED_TOKENS, "Prompt tokens served from the prefix cache (most any server row saw)."),
     facts.i64(col.FIRST_TOKEN_NS, "First visible content sent (first_content_ns), else first token delivered; "
                                   "ns, reference clock."),
     facts.i64(LAST_TOKEN, "Delivery of the request's last token; ns, reference clock."),
     facts.i64(col.NUM_OUTPUT_TOKENS, "Tokens delivered."),
     facts.i64(col.INSTANCE_ID, "The instance that emitted token 0, else the lowest instance of its rows."),
     facts.i64(TTFT_NS, "first_token_ns - arrival_ns."),
     facts.f64(TPOT_NS, "(last - first token) / (tokens - 1); null with one token."),
     facts.i64(E2E_NS, "Finish (else last token) - arrival; null without a first token.")),
    select=_request_facts_sql)


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
