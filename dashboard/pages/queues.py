"""Queues: waiting, running and preempted requests over time; queueing delay; Little's law check."""

from __future__ import annotations

from typing import Any

import dash

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars, explained, graph_or_notice, lines, table
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.schema import col

PATH = "/queues"
dash.register_page(__name__, path=PATH, name="Queues", title="tokentrace · queues")


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Queue analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    report = src.result(rid, RunAnalysis.queues)
    names = src.instance_names(rid)
    timeline = graph_or_notice(report.timeline, "queues-timeline", lambda f: lines(
        f, "t_s", [col.NUM_WAITING, col.NUM_RUNNING, col.NUM_PREEMPTED], group=col.INSTANCE_ID,
        instance_names=names, title="Requests waiting, running and preempted, per engine instance",
        xaxis="s since the run started", yaxis="requests (mean over the steps of each second)"),
        "This run has no engine steps, so no queue lengths.")
    delay = graph_or_notice(report.delay, "queues-delay", lambda f: bars(
        f, col.SLO_CLASS, ["p50_ms", "p90_ms", "p99_ms", "max_ms"], title="Queueing delay by SLO class",
        yaxis="ms"), "No request waited in schedule.queue in this run.")
    little = report.littles_law
    little_part = (table(little, "queues-littles-law", instance_names=names) if len(little)
                   else notice("No steps to check Little's law on."))
    return [explained("Queue lengths", EXPLAIN["queues_timeline"], timeline),
            explained("Queueing delay", EXPLAIN["queue_delay"], delay),
            explained("Little's law", EXPLAIN["littles_law"], little_part)]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Queues", query, body, controls)


live_callback(PATH, body)
