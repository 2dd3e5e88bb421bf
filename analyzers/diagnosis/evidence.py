"""The evidence a diagnosis reads, fetched from a :class:`~analyzers.source.Source` in a few queries.

Every query is plain DuckDB SQL over the source's views (so it runs on Spark too) and returns
a small frame: all requests' facts, the token gaps over their ITL target, the spans of the
requests that missed, the engine steps, every prefill interval (who held the step budget),
evictions, late event-loop ticks, rejected speculative work, the client's view, each stage's
typical span, what each session turn carried from the previous turn, the prompt tokens past each
request's prefix hit that the cache had held and evicted (its first ``miss_evicted`` event, with its time), and which requests each
engine step computed (its seats), the last token each missed request held back until its first visible content
(its spans count in TTFT), the first token each process emitted for it (its spans work toward that
one or a later one) and each instance's role (its pool). Times stay integer ns on the reference clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from analyzers.loop_lag import late_intervals_sql
from analyzers.source import Source, client_instance_ids
from analyzers.timing import (
    COUNTED_IN,
    E2E_NS,
    LAST_TOKEN,
    LATENCY,
    TOKEN_END,
    TOKEN_START,
    TPOT_NS,
    TTFT_NS,
    request_table,
    token_times,
)
from tokentrace.schema import CacheEventKind, Stage, col

__all__ = ["Evidence", "gather", "requests_frame", "gap_tokens"]

MISSED_TABLE = "diagnosis_missed"  # registered: request_id of every request that missed a target
ITL_TABLE = "diagnosis_itl_targets"  # registered: slo_class_name -> itl target, ns


@dataclass(frozen=True, slots=True, eq=False)
class Evidence:
    """What the rules read (frames described in :func:`gather`)."""

    requests: pd.DataFrame
    gaps: pd.DataFrame
    spans: pd.DataFrame
    steps: pd.DataFrame
    prefills: pd.DataFrame
    evictions: pd.DataFrame
    loop_lags: pd.DataFrame
    speculation: pd.DataFrame
    client: pd.DataFrame
    stage_typical: pd.DataFrame
    carried: pd.DataFrame
    evicted_prefix: pd.DataFrame
    seats: pd.DataFrame
    held: pd.DataFrame
    emitted: pd.DataFrame
    roles: pd.DataFrame


def requests_frame(src: Source) -> pd.DataFrame:
    """Every request's facts (``analyzers.timing.request_table``), ordered by arrival."""
    c = col
    return src.df(f"""
        SELECT {c.REQUEST_ID}, {c.REQUEST_KEY}, {c.TENANT}, {c.SLO_CLASS}, {c.ARRIVAL_NS}, {c.FIRST_TOKEN_NS},
               {LAST_TOKEN}, {c.FINISH_NS}, {c.NUM_PROMPT_TOKENS}, {c.NUM_CACHED_TOKENS}, {c.NUM_OUTPUT_TOKENS},
               {c.STATUS}, {c.INSTANCE_ID}, {TTFT_NS}, {TPOT_NS}, {E2E_NS}
        FROM {request_table(src)} WHERE {c.ARRIVAL_NS} IS NOT NULL ORDER BY {c.ARRIVAL_NS}, {c.REQUEST_ID}
    """)


def gap_tokens(src: Source, itl_ns: dict[str, int]) -> pd.DataFrame:
    """Token gaps (index > 0) longer than their request's class's ITL target: request_id, token_index,
    token_start_ns, token_end_ns, latency_ns."""
    c = col
    if not itl_ns:
        return pd.DataFrame(columns=[c.REQUEST_ID, c.TOKEN_INDEX, TOKEN_START, TOKEN_END, LATENCY])
    src.register(ITL_TABLE, pd.DataFrame({c.SLO_CLASS: list(itl_ns), "itl_ns": [int(v) for v in itl_ns.values()]}))
    try:
        return src.df(f"""
            SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{TOKEN_START}, t.{TOKEN_END}, t.{LATENCY}
            FROM {token_times(src)} t JOIN {request_table(src)} r ON t.{c.REQUEST_ID} = r.{c.REQUEST_ID}
                 JOIN {ITL_TABLE} d ON r.{c.SLO_CLASS} = d.{c.SLO_CLASS}
            WHERE t.{c.TOKEN_INDEX} > 0 AND t.{LATENCY} > d.itl_ns
            ORDER BY t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}
        """)
    finally:
        src.unregister(ITL_TABLE)


def gather(src: Source, requests: pd.DataFrame, gaps: pd.DataFrame, missed: list[int]) -> Evidence:
    """The evidence for the requests ``missed`` (their spans) and the run around them (everything else)."""
    c = col
    src.register(MISSED_TABLE, pd.DataFrame({c.REQUEST_ID: pd.Series(missed, dtype="int64")}))
    try:
        spans = src.df(f"""
            SELECT s.{c.REQUEST_ID}, s.{c.STAGE}, s.{c.TOKEN_INDEX}, s.{c.START_NS}, s.{c.END_NS}, s.{c.INSTANCE_ID},
                   s.{c.STEP}
            FROM srv_spans s JOIN {MISSED_TABLE} m ON s.{c.REQUEST_ID} = m.{c.REQUEST_ID}
            ORDER BY s.{c.REQUEST_ID}, s.{c.START_NS}
        """)
        held = src.df(f"""
            SELECT t.{c.REQUEST_ID}, MAX(t.{c.TOKEN_INDEX}) AS last_held
            FROM {token_times(src)} t JOIN {MISSED_TABLE} m ON t.{c.REQUEST_ID} = m.{c.REQUEST_ID}
            WHERE t.{COUNTED_IN} = 0 GROUP BY t.{c.REQUEST_ID}
        """)
        emitted = src.df(f"""
            SELECT t.{c.REQUEST_ID}, t.{c.INSTANCE_ID}, MIN(t.{c.TOKEN_INDEX}) AS first_emitted
            FROM srv_tokens t JOIN {MISSED_TABLE} m ON t.{c.REQUEST_ID} = m.{c.REQUEST_ID}
            WHERE t.{c.EMIT_NS} IS NOT NULL GROUP BY t.{c.REQUEST_ID}, t.{c.INSTANCE_ID}
        """)
        speculation = src.df(f"""
            SELECT p.{c.REQUEST_ID}, p.{c.FIRST_TOKEN_INDEX}, p.{c.NUM_PROPOSED}, p.{c.NUM_ACCEPTED},
                   p.{c.DRAFT_START_NS}, p.{c.DRAFT_END_NS}, p.{c.VERIFY_START_NS}, p.{c.VERIFY_END_NS}
            FROM spec_steps p JOIN {MISSED_TABLE} m ON p.{c.REQUEST_ID} = m.{c.REQUEST_ID}
        """)
    finally:
        src.unregister(MISSED_TABLE)
    steps = src.df(f"""
        SELECT {c.INSTANCE_ID}, {c.STEP}, {c.START_NS}, {c.END_NS}, {c.NUM_SEQS}, {c.NUM_PREFILL_TOKENS},
               {c.NUM_DECODE_TOKENS}, {c.NUM_WAITING}, {c.NUM_RUNNING}, {c.NUM_PREEMPTED}, {c.NUM_BLOCKS_USED_DEVICE},
               {c.NUM_BLOCKS_TOTAL_DEVICE}
        FROM steps ORDER BY {c.INSTANCE_ID}, {c.START_NS}
    """)
    prefills = src.df(f"""
        SELECT {c.REQUEST_ID}, {c.INSTANCE_ID}, {c.STEP}, {c.START_NS}, {c.END_NS}
        FROM srv_spans WHERE {c.STAGE} = {int(Stage.PREFILL_COMPUTE)} ORDER BY {c.INSTANCE_ID}, {c.START_NS}
    """)
    evictions = src.df(f"""
        SELECT {c.INSTANCE_ID}, {c.START_NS}, {c.NUM_BLOCKS} FROM cache_events
        WHERE {c.KIND} = {int(CacheEventKind.EVICT)} ORDER BY {c.START_NS}
    """)
    loop_lags = src.df(f"{late_intervals_sql()} ORDER BY {c.START_NS}")
    seats = src.df(f"""
        SELECT DISTINCT {c.REQUEST_ID}, {c.INSTANCE_ID}, {c.STEP} FROM srv_spans
        WHERE {c.STAGE} IN ({int(Stage.PREFILL_COMPUTE)}, {int(Stage.DECODE_COMPUTE)}) AND {c.STEP} IS NOT NULL
    """)
    carried = src.df(f"""
        SELECT {c.REQUEST_ID}, MAX({c.NUM_TOKENS}) AS carried_tokens FROM cache_events
        WHERE {c.KIND} = {int(CacheEventKind.CARRY)} AND {c.NUM_TOKENS} > 0 GROUP BY {c.REQUEST_ID}
    """)
    evicted_prefix = src.df(f"""
        WITH first_lookup AS (
            SELECT {c.REQUEST_ID}, MIN({c.START_NS}) AS lookup_ns FROM cache_events
            WHERE {c.KIND} = {int(CacheEventKind.MISS_EVICTED)} GROUP BY {c.REQUEST_ID}
        )
        SELECT e.{c.REQUEST_ID}, MIN(f.lookup_ns) AS lookup_ns, MAX(e.{c.NUM_TOKENS}) AS evicted_tokens
        FROM cache_events e JOIN first_lookup f ON e.{c.REQUEST_ID} = f.{c.REQUEST_ID} AND e.{c.START_NS} = f.lookup_ns
        WHERE e.{c.KIND} = {int(CacheEventKind.MISS_EVICTED)} GROUP BY e.{c.REQUEST_ID}
    """)
    stage_typical = src.df(f"""
        SELECT {c.STAGE}, quantile_cont({c.END_NS} - {c.START_NS}, 0.5) AS median_ns, COUNT(*) AS num_spans
        FROM srv_spans GROUP BY {c.STAGE}
    """)
    roles = src.df(f"SELECT {c.INSTANCE_ID}, {c.ROLE} FROM instances")
    return Evidence(requests=requests, gaps=gaps, spans=spans, steps=steps, prefills=prefills, evictions=evictions,
                    loop_lags=loop_lags, speculation=speculation, client=_client_view(src),
                    stage_typical=stage_typical, carried=carried, evicted_prefix=evicted_prefix, seats=seats, held=held,
                    emitted=emitted, roles=roles)


def _client_view(src: Source) -> pd.DataFrame:
    """Per request the client saw: request_id, sent (its arrival row), first chunk received, last received."""
    c = col
    clients = client_instance_ids(src.arrow("SELECT * FROM instances"))
    if not clients:
        return pd.DataFrame(columns=[c.REQUEST_ID, "client_sent_ns", "client_first_ns", "client_last_ns"])
    ids = ", ".join(map(str, clients))
    return src.df(f"""
        WITH sent AS (
            SELECT {c.REQUEST_ID}, MIN({c.ARRIVAL_NS}) AS client_sent_ns FROM requests
            WHERE {c.INSTANCE_ID} IN ({ids}) GROUP BY {c.REQUEST_ID}
        ), got AS (
            SELECT {c.REQUEST_ID}, MIN({c.RECV_NS}) AS client_first_ns, MAX({c.RECV_NS}) AS client_last_ns
            FROM tokens WHERE {c.INSTANCE_ID} IN ({ids}) GROUP BY {c.REQUEST_ID}
        )
        SELECT s.{c.REQUEST_ID}, s.client_sent_ns, g.client_first_ns, g.client_last_ns
        FROM sent s JOIN got g ON s.{c.REQUEST_ID} = g.{c.REQUEST_ID}
    """)
