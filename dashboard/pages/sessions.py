"""Sessions: cross-turn prefix reuse per turn (from which tier, and what was lost during think time), each
session's time split into waiting for first tokens, generating and thinking, and fairness per session."""

from __future__ import annotations

from typing import Any

import dash
from dash import html

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars, explained, graph_or_notice, table
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.app.report.sessions import NO_SESSIONS, session_sentences
from tokentrace.schema import col

PATH = "/sessions"
dash.register_page(__name__, path=PATH, name="Sessions", title="tokentrace · sessions and KV retention")

_REUSE = ["reused_device_tokens", "reused_host_tokens", "reused_disk_tokens", "lost_tokens"]
_TIME = ["ttft_sum_ms", "generation_ms", "think_ms"]
_SESSION_COLUMNS = [col.SESSION, col.TENANT, "num_turns", "ttft_sum_ms", "generation_ms", "think_ms",
                    "carried_tokens", "reused_tokens", "lost_tokens", "reuse_fraction", "extra_prefill_ms", "load_ms"]
_TURN_COLUMNS = [col.SESSION, "turn", "think_ms", "ttft_ms", col.NUM_PROMPT_TOKENS, "carried_tokens",
                 "reused_tokens", "lost_tokens", "extra_prefill_ms", "load_ms"]
MAX_SESSIONS_DRAWN = 40  # the per-session chart keeps the sessions with the longest TTFT sums
MAX_LISTED_SESSIONS = 1000  # the session table lists the sessions with the longest TTFT sums (the browser gets
# every listed row)
MAX_LISTED_TURN_SESSIONS = 200  # the turn table lists the turns of this many of them


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Session analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    rep = src.result(rid, RunAnalysis.sessions)
    if rep.empty:
        return [notice(NO_SESSIONS)]
    sentences = html.Div([html.P(s) for s in session_sentences(rep)], id="sessions-sentences",
                         className="tt-verdict tt-unjudged")
    measured = rep.turns[rep.turns["carried_tokens"].notna()]
    per_turn = (measured.groupby("turn", as_index=False)[_REUSE].sum().astype({"turn": str})
                if len(measured) else measured)
    reuse = graph_or_notice(per_turn, "sessions-reuse", lambda f: bars(
        f, "turn", _REUSE, title="Carried prefix tokens per turn: reused (by tier) and lost", yaxis="tokens",
        barmode="stack", names=["reused from device", "reused from host", "reused from disk",
                                "lost during think time"]),
        "Cross-turn reuse not measured: the server reported no carried prefixes.")
    drawn = rep.sessions.sort_values("ttft_sum_ms", ascending=False).head(MAX_SESSIONS_DRAWN)
    time_split = graph_or_notice(drawn, "sessions-time", lambda f: bars(
        f, col.SESSION, _TIME, title="Time per session", yaxis="ms", barmode="stack",
        names=["waiting for first tokens", "generating", "thinking between turns"]),
        "No session has a finished turn.")
    fairness = (table(rep.fairness, "sessions-fairness") if len(rep.fairness)
                else notice("No tenant has a session with a first token."))
    listed = _longest(rep.sessions, MAX_LISTED_SESSIONS)
    turn_sessions = _longest(rep.sessions, MAX_LISTED_TURN_SESSIONS)[col.SESSION]
    turns = rep.turns if len(turn_sessions) == len(rep.sessions) else rep.turns[
        rep.turns[col.SESSION].isin(turn_sessions)]
    return [sentences,
            explained("Cross-turn reuse", EXPLAIN["session_reuse"], reuse),
            explained("Session latency", EXPLAIN["session_time"], time_split),
            explained("Sessions", EXPLAIN["session_table"], *_listed_note(len(listed), len(rep.sessions), "The {n} sessions"),
                      table(listed[_SESSION_COLUMNS], "sessions-table", highlight=None)),
            explained("Turns", EXPLAIN["session_turns"],
                      *_listed_note(len(turn_sessions), len(rep.sessions), "The turns of the {n} sessions"),
                      table(turns[_TURN_COLUMNS], "sessions-turns")),
            explained("Fairness per session", EXPLAIN["session_fairness"], fairness)]


def _longest(sessions: Any, limit: int) -> Any:
    """The ``limit`` sessions with the longest TTFT sums, in the analysis's order (all when there are no more)."""
    if len(sessions) <= limit:
        return sessions
    return sessions.loc[sessions["ttft_sum_ms"].nlargest(limit, keep="first").index.sort_values()]


def _listed_note(listed: int, total: int, what: str) -> list[Any]:
    """A line saying that only part of the rows is listed (nothing when every row is); ``what`` names the listed
    rows, ``{n}`` standing for the number of sessions they come from."""
    if listed >= total:
        return []
    return [html.P(f"{what.format(n=f'{listed:,}')} with the longest TTFT sums are listed, of {total:,} sessions.",
                   className="tt-explain")]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Sessions and KV retention", query, body, controls)


live_callback(PATH, body)
