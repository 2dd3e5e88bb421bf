"""Sessions: multi-turn conversations and agent loops, turn by turn.

A session is the requests that share ``requests.session_name``. Its turns are numbered
by ``session_turn`` when the client numbered them, else by arrival. Per turn:

* latency: TTFT, generation (first token -> finish) and the think time before it (the
  previous turn's finish -> this turn's arrival: the user's reading time or the tool call);
* cross-turn reuse: *carried* tokens are the leading prompt tokens whose KV the session's
  previous turn had computed (the engine's ``carry`` cache event at admission, whatever
  the retention policy did with them); *reused* tokens are the carried ones the prefix
  cache still served at that admission (its ``hit`` events of the same engine step, per tier:
  device, host, disk; a later lookup after a preemption finds the turn's own blocks and does
  not count), i.e. ``min(hit, carried)``; *lost* tokens = carried - reused: KV evicted (or dropped) during the think
  time, which the turn computed again;
* what the loss cost: ``extra_prefill_ms`` = the turn's ``prefill.compute`` time x lost /
  prompt tokens it computed (prefill time is taken as linear in tokens), and ``load_ms``
  = its ``cache.load`` time (carried KV brought up from a lower tier instead).

Turns of servers that emit no ``carry`` events have null carried, reused and lost
tokens ("not measured"), never 0. Tenant fairness is counted per session as well as per
request (:func:`session_fairness`). Pure functions: a :class:`~analyzers.source.Source`
in, DataFrames out.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from analyzers.source import Source
from analyzers.timing import LAST_TOKEN, TTFT_NS, request_table
from tokentrace.schema import CacheEventKind, Stage, Tier, col

__all__ = ["SessionReport", "sessions", "session_turns", "session_summary", "retention_summary", "session_fairness",
           "TURN", "THINK_MS"]

TURN = "turn"
"""Column: the 0-based turn of a request in its session (as sent, else by arrival)."""
THINK_MS = "think_ms"
"""Column: the previous turn's finish -> this turn's arrival, ms (null for the first turn)."""

_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


def _turns_sql(src: Source) -> str:
    """One row per session turn (server view), with its cache facts (see the module doc)."""
    c = col
    facts = request_table(src)
    hit_tiers = ",\n".join(
        f"SUM(CASE WHEN {c.TIER} = {int(t)} THEN {c.NUM_BLOCKS} ELSE 0 END) AS hit_blocks_{t.label}" for t in _TIERS)
    reused_tiers = ",\n".join(
        f"CASE WHEN cr.carried_blocks IS NULL THEN NULL ELSE "
        f"LEAST(COALESCE(h.hit_blocks_{t.label}, 0), GREATEST(cr.carried_blocks - {_before(t)}, 0)) "
        f"* CAST(COALESCE(cr.block_tokens, 0) AS BIGINT) END "
        f"AS reused_{t.label}_tokens"
        for t in _TIERS)
    return f"""
    WITH sess AS (
        SELECT {c.REQUEST_ID}, MAX({c.SESSION}) AS {c.SESSION}, MIN({c.SESSION_TURN}) AS given_turn
        FROM srv_requests WHERE {c.SESSION} IS NOT NULL AND {c.SESSION} <> ''
        GROUP BY {c.REQUEST_ID}
    ), carry AS (
        SELECT {c.REQUEST_ID}, {c.INSTANCE_ID}, MAX({c.NUM_BLOCKS}) AS carried_blocks,
               MAX({c.NUM_TOKENS}) AS carried_tokens, MIN({c.STEP}) AS carry_step
        FROM cache_events WHERE {c.KIND} = {int(CacheEventKind.CARRY)}
        GROUP BY {c.REQUEST_ID}, {c.INSTANCE_ID}
    ), cr AS (
        SELECT {c.REQUEST_ID}, arg_max({c.INSTANCE_ID}, carried_blocks) AS carry_instance,
               arg_max(carry_step, carried_blocks) AS carry_step,
               MAX(carried_blocks) AS carried_blocks, MAX(carried_tokens) AS carried_tokens,
               CASE WHEN MAX(carried_blocks) > 0 THEN MAX(carried_tokens) / MAX(carried_blocks) END AS block_tokens
        FROM carry GROUP BY {c.REQUEST_ID}
    ), h AS (
        SELECT e.{c.REQUEST_ID}, {hit_tiers}
        FROM cache_events e JOIN cr ON e.{c.REQUEST_ID} = cr.{c.REQUEST_ID} AND e.{c.INSTANCE_ID} = cr.carry_instance
             AND e.{c.STEP} = cr.carry_step
        WHERE e.{c.KIND} = {int(CacheEventKind.HIT)}
        GROUP BY e.{c.REQUEST_ID}
    ), work AS (
        SELECT {c.REQUEST_ID},
               SUM(CASE WHEN {c.STAGE} = {int(Stage.PREFILL_COMPUTE)} THEN {c.END_NS} - {c.START_NS} ELSE 0 END)
                   AS prefill_ns,
               SUM(CASE WHEN {c.STAGE} = {int(Stage.CACHE_LOAD)} THEN {c.END_NS} - {c.START_NS} ELSE 0 END)
                   AS load_ns
        FROM srv_spans WHERE {c.STAGE} IN ({int(Stage.PREFILL_COMPUTE)}, {int(Stage.CACHE_LOAD)})
        GROUP BY {c.REQUEST_ID}
    ), base AS (
        SELECT s.{c.SESSION}, f.{c.REQUEST_ID}, f.{c.REQUEST_KEY}, f.{c.TENANT},
               COALESCE(s.given_turn, ROW_NUMBER() OVER (PARTITION BY s.{c.SESSION} ORDER BY f.{c.ARRIVAL_NS}) - 1)
                   AS {TURN},
               f.{c.ARRIVAL_NS}, COALESCE(f.{c.FINISH_NS}, f.{LAST_TOKEN}) AS end_ns,
               f.{TTFT_NS} / 1e6 AS ttft_ms,
               (COALESCE(f.{c.FINISH_NS}, f.{LAST_TOKEN}) - f.{c.FIRST_TOKEN_NS}) / 1e6 AS generation_ms,
               f.{c.NUM_PROMPT_TOKENS}, f.{c.NUM_CACHED_TOKENS}, f.{c.NUM_OUTPUT_TOKENS},
               cr.carried_tokens, {reused_tiers},
               w.prefill_ns, w.load_ns
        FROM sess s JOIN {facts} f ON s.{c.REQUEST_ID} = f.{c.REQUEST_ID}
        LEFT JOIN cr ON cr.{c.REQUEST_ID} = f.{c.REQUEST_ID}
        LEFT JOIN h ON h.{c.REQUEST_ID} = f.{c.REQUEST_ID}
        LEFT JOIN work w ON w.{c.REQUEST_ID} = f.{c.REQUEST_ID}
    ), turns AS (
        SELECT *, reused_device_tokens + reused_host_tokens + reused_disk_tokens AS reused_tokens,
               ({c.ARRIVAL_NS} - LAG(end_ns) OVER (PARTITION BY {c.SESSION} ORDER BY {TURN}, {c.ARRIVAL_NS})) / 1e6
                   AS {THINK_MS}
        FROM base
    )
    SELECT {c.SESSION}, {TURN}, {c.REQUEST_ID}, {c.REQUEST_KEY}, {c.TENANT}, {c.ARRIVAL_NS}, {THINK_MS},
           ttft_ms, generation_ms, {c.NUM_PROMPT_TOKENS}, {c.NUM_CACHED_TOKENS}, {c.NUM_OUTPUT_TOKENS},
           carried_tokens, reused_tokens, reused_device_tokens, reused_host_tokens, reused_disk_tokens,
           carried_tokens - reused_tokens AS lost_tokens,
           CASE WHEN carried_tokens > 0 THEN reused_tokens * 1.0 / carried_tokens END AS reuse_fraction,
           CASE WHEN {c.NUM_PROMPT_TOKENS} > 0 THEN {c.NUM_CACHED_TOKENS} * 1.0 / {c.NUM_PROMPT_TOKENS} END
               AS prompt_cached_fraction,
           CASE WHEN carried_tokens IS NULL THEN NULL
                WHEN {c.NUM_PROMPT_TOKENS} - COALESCE({c.NUM_CACHED_TOKENS}, 0) > 0
                THEN COALESCE(prefill_ns, 0) / 1e6 * (carried_tokens - reused_tokens)
                     / ({c.NUM_PROMPT_TOKENS} - COALESCE({c.NUM_CACHED_TOKENS}, 0))
                ELSE 0 END AS extra_prefill_ms,
           COALESCE(load_ns, 0) / 1e6 AS load_ms
    FROM turns
    """


def _turns(src: Source) -> str:
    """Name of the temp table of :func:`_turns_sql`'s rows, built once per source (every session table reads it)."""
    def build() -> str:
        src.execute(f"CREATE OR REPLACE TEMP TABLE session_turn_facts AS {_turns_sql(src)}")
        return "session_turn_facts"
    return src.cached("session_turn_facts", build)


def _before(tier: Tier) -> str:
    """SQL: hit blocks of the tiers searched before ``tier`` (a match fills the prompt's leading blocks from the
    device tier first only as far as each block is found there; the order across tiers is not recorded, so reused
    carried blocks are credited to tiers in search order)."""
    earlier = [t for t in _TIERS if t < tier]
    if not earlier:
        return "0"
    return "(" + " + ".join(f"COALESCE(h.hit_blocks_{t.label}, 0)" for t in earlier) + ")"


def session_turns(src: Source) -> pd.DataFrame:
    """One row per turn of every session, ordered by session and turn (columns: see the module doc)."""
    return src.df(f"SELECT * FROM {_turns(src)} t ORDER BY {col.SESSION}, {TURN}, {col.ARRIVAL_NS}")


def session_summary(src: Source) -> pd.DataFrame:
    """One row per session: turns, time spent waiting for first tokens, generating and thinking, and
    cross-turn reuse (carried, reused, lost tokens, the reuse fraction, and what the losses cost)."""
    c = col
    return src.df(f"""
        SELECT {c.SESSION}, MIN({c.TENANT}) AS {c.TENANT}, COUNT(*) AS num_turns,
               SUM(ttft_ms) AS ttft_sum_ms, SUM(generation_ms) AS generation_ms,
               COALESCE(SUM({THINK_MS}), 0) AS think_ms,
               (MAX({c.ARRIVAL_NS} + (ttft_ms + generation_ms) * 1e6) - MIN({c.ARRIVAL_NS})) / 1e6 AS session_ms,
               SUM({c.NUM_PROMPT_TOKENS}) AS num_prompt_tokens, SUM({c.NUM_CACHED_TOKENS}) AS num_cached_tokens,
               SUM(carried_tokens) AS carried_tokens, SUM(reused_tokens) AS reused_tokens,
               SUM(lost_tokens) AS lost_tokens,
               CASE WHEN SUM(carried_tokens) > 0 THEN SUM(reused_tokens) * 1.0 / SUM(carried_tokens) END
                   AS reuse_fraction,
               SUM(extra_prefill_ms) AS extra_prefill_ms, SUM(load_ms) AS load_ms
        FROM {_turns(src)} t
        GROUP BY {c.SESSION} ORDER BY {c.SESSION}
    """)


def retention_summary(src: Source) -> pd.DataFrame:
    """One row for the run: sessions and turns, carried / reused (per tier) / lost tokens over every
    turn that reports carries, the reuse fraction, the extra prefill and load time, and the
    retention policy's own record (blocks pinned and for how long, blocks dropped). Empty without sessions."""
    c = col
    turns = _turns(src)
    row = src.df(f"""
        SELECT COUNT(DISTINCT {c.SESSION}) AS num_sessions, COUNT(*) AS num_turns,
               COUNT(carried_tokens) AS num_measured_turns,
               SUM(carried_tokens) AS carried_tokens, SUM(reused_tokens) AS reused_tokens,
               SUM(reused_device_tokens) AS reused_device_tokens, SUM(reused_host_tokens) AS reused_host_tokens,
               SUM(reused_disk_tokens) AS reused_disk_tokens, SUM(lost_tokens) AS lost_tokens,
               CASE WHEN SUM(carried_tokens) > 0 THEN SUM(reused_tokens) * 1.0 / SUM(carried_tokens) END
                   AS reuse_fraction,
               SUM(extra_prefill_ms) AS extra_prefill_ms, SUM(load_ms) AS load_ms,
               AVG({THINK_MS}) AS mean_think_ms, AVG(ttft_ms) AS mean_ttft_ms
        FROM {turns} t
    """)
    if row.empty or not int(row["num_turns"].iloc[0] or 0):
        return row.iloc[0:0]
    kept = src.df(f"""
        SELECT SUM(CASE WHEN {c.KIND} = {int(CacheEventKind.RETAIN)} THEN {c.NUM_BLOCKS} ELSE 0 END) AS retained_blocks,
               AVG(CASE WHEN {c.KIND} = {int(CacheEventKind.RETAIN)} THEN ({c.END_NS} - {c.START_NS}) / 1e6 END)
                   AS mean_retain_ms,
               SUM(CASE WHEN {c.KIND} = {int(CacheEventKind.DROP)} THEN {c.NUM_BLOCKS} ELSE 0 END) AS dropped_blocks
        FROM cache_events
        WHERE {c.KIND} IN ({int(CacheEventKind.RETAIN)}, {int(CacheEventKind.DROP)})
    """)
    for name in kept.columns:
        row[name] = kept[name].iloc[0]
    return row


def session_fairness(src: Source) -> pd.DataFrame:
    """Per tenant: sessions and requests, each tenant's share of sessions and of requests, and the
    per-session TTFT burden (sum of a session's TTFTs: mean and p90 over its sessions) beside the
    per-request mean TTFT. A tenant whose sessions are long looks fine per request and slow per session."""
    c = col
    return src.df(f"""
        WITH t AS (SELECT * FROM {_turns(src)}),
        s AS (
            SELECT {c.TENANT}, {c.SESSION}, SUM(ttft_ms) AS ttft_sum_ms, COUNT(*) AS n
            FROM t GROUP BY {c.TENANT}, {c.SESSION}
        ), per AS (
            SELECT {c.TENANT}, COUNT(*) AS num_sessions, CAST(SUM(n) AS BIGINT) AS num_requests,
                   AVG(ttft_sum_ms) AS mean_session_ttft_ms,
                   quantile_cont(ttft_sum_ms, 0.9) AS p90_session_ttft_ms
            FROM s GROUP BY {c.TENANT}
        ), req AS (
            SELECT {c.TENANT}, AVG(ttft_ms) AS mean_request_ttft_ms FROM t GROUP BY {c.TENANT}
        )
        SELECT per.{c.TENANT}, num_sessions, num_requests,
               num_sessions * 1.0 / SUM(num_sessions) OVER () AS session_share,
               num_requests * 1.0 / SUM(num_requests) OVER () AS request_share,
               mean_session_ttft_ms, p90_session_ttft_ms, mean_request_ttft_ms
        FROM per JOIN req ON per.{c.TENANT} = req.{c.TENANT}
        ORDER BY per.{c.TENANT}
    """)


@dataclass(frozen=True, slots=True)
class SessionReport:
    """Every session table of one run (empty frames when the run has no sessions)."""

    turns: pd.DataFrame
    sessions: pd.DataFrame
    retention: pd.DataFrame
    fairness: pd.DataFrame

    @property
    def empty(self) -> bool:
        return self.turns.empty


def sessions(src: Source) -> SessionReport:
    """:func:`session_turns`, :func:`session_summary`, :func:`retention_summary` and :func:`session_fairness`."""
    return SessionReport(session_turns(src), session_summary(src), retention_summary(src), session_fairness(src))
