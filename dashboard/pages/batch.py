"""Batch and interference: step time and ITL by batch size; what the slowest decode tokens shared their step with."""

from __future__ import annotations

from typing import Any

import dash

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars_row, explained, graph_or_notice, lines
from dashboard.components.shell import ViewQuery, live_callback, page
from dashboard.data import DataSource

PATH = "/batch"
dash.register_page(__name__, path=PATH, name="Batch", title="tokentrace · batch and interference")


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Batch analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    by_size = src.result(rid, RunAnalysis.batch)
    inter = src.result(rid, RunAnalysis.interference)
    size = graph_or_notice(by_size, "batch-size", lambda f: lines(
        f, "batch_size_lo", ["mean_step_ms", "p99_step_ms", "mean_itl_ms", "p99_itl_ms"],
        title="Step time and ITL by batch size", xaxis="sequences in the step (bin start)", yaxis="ms", group="role"),
        "This run has no engine steps.")
    tail = bars_row(inter, "group", [("mean_itl_ms", "ITL", "ms"), ("mean_step_ms", "Step time", "ms"),
                                     ("mean_batch_size", "Batch size", "sequences"),
                                     ("mean_other_prefill_tokens", "Other requests' prefill", "tokens")],
                    "batch-interference", "No decode tokens with steps in this run.")
    return [explained("Batch size", EXPLAIN["batch"], size),
            explained("Interference", EXPLAIN["interference"], tail)]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Batch and interference", query, body, controls)


live_callback(PATH, body)
