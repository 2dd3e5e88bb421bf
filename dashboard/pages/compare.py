"""Compare: a candidate run against a baseline, each metric's change against run-to-run noise (one run a side, the
documented noise figure), with the smallest change the comparison could detect; regressions in vermillion,
improvements in blue."""

from __future__ import annotations

from typing import Any

import dash
import pandas as pd
import plotly.graph_objects as go

from analyzers.compare import explain
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import explained, graph, table
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.palette import BETTER_COLOUR, UNCHANGED_COLOUR, WORSE_COLOUR

PATH = "/compare"
dash.register_page(__name__, path=PATH, name="Compare", title="tokentrace · compare runs")


_TABLE_COLUMNS = ["metric", "statistic", "unit", "baseline", "candidate", "delta", "rel_change", "rel_ci_low",
                  "rel_ci_high", "noise", "p_adjusted", "verdict", "min_detectable", "runs_needed", "n_baseline",
                  "n_candidate", "significant", "regression"]


def change_figure(frame: pd.DataFrame) -> go.Figure:
    """Relative change of every significant row (all rows if none is): regressions vermillion, improvements blue,
    the rest grey (the core palette's change colours, told apart by colour-blind readers).

    Rows without a relative change (a near-zero baseline) are in the table, not in the figure."""
    rows = frame[frame["significant"]] if frame["significant"].any() else frame
    rows = rows[rows["rel_change"].notna()]
    labels = rows["metric"] + " · " + rows["statistic"]
    colors = [WORSE_COLOUR if r else (BETTER_COLOUR if s else UNCHANGED_COLOUR)
              for r, s in zip(rows["regression"], rows["significant"])]
    err = dict(type="data", symmetric=False, array=(rows["rel_ci_high"] - rows["rel_change"]).clip(lower=0).tolist(),
               arrayminus=(rows["rel_change"] - rows["rel_ci_low"]).clip(lower=0).tolist())
    fig = go.Figure(go.Bar(y=labels.tolist(), x=rows["rel_change"].tolist(), orientation="h", marker_color=colors,
                           error_x=err, name="relative change"))
    fig.update_layout(template="plotly_white", title="Relative change, candidate against baseline (95% interval "
                                                     "from run-to-run noise)",
                      xaxis_tickformat="+.0%", height=max(300, 26 * len(rows) + 120),
                      margin=dict(l=200, r=20, t=50, b=50))
    return fig


def _default_base(src: DataSource, q: ViewQuery) -> str:
    """The baseline: ``q.base``, else the run before the candidate."""
    if q.base:
        return src.resolve(q.base)
    ids = [i.run_id for i in src.runs()]
    cand = src.resolve(q.run)
    older = ids[:ids.index(cand)]
    if not older:
        raise ValueError("Pick a baseline: the candidate is the oldest run of the store.")
    return older[-1]


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """The diff of run ``q.run`` (candidate) against ``q.base`` (baseline)."""
    cand = src.resolve(q.run)
    if len(src.runs()) < 2:
        return [notice("This store holds one run: there is nothing to compare it with.")]
    base = _default_base(src, q)
    if base == cand:
        return [notice("Baseline and candidate are the same run: pick two different runs.")]
    diff = src.compare(cand, base)
    if len(diff) == 0:
        return [notice("The two runs have no latency samples to compare.")]
    regressions = diff[diff["regression"]]
    stages = regressions[regressions["metric"].str.startswith("stage.")].sort_values("delta", ascending=False)
    latency = regressions[~regressions["metric"].str.startswith("stage.")]
    summary = (f"{len(regressions)} regression(s) of {cand} against {base} past run-to-run noise: "
               + ", ".join(latency["metric"] + " " + latency["statistic"])
               + ("; stages: " + "; ".join(explain(diff)) if len(stages) else "")
               if len(regressions) else f"No regression of {cand} against {base} past run-to-run noise.")
    means = diff[(diff["statistic"] == "mean") & diff["metric"].isin(["ttft", "itl"]) & diff["min_detectable"].notna()]
    detectable = ("One run a side detects changes of at least "
                  + ", ".join(f"{r.min_detectable:.0%} in {r.metric.upper()}" for r in means.itertuples())
                  + f" (noise from {diff['noise_source'].iloc[0]}); compare several runs a side with "
                    "tokentrace report --baseline STORE:'RUN-*'." if len(means) else "")
    group = diff["metric"].str.startswith("stage.").astype(int) + 2 * (diff["unit"] != "ms").astype(int)
    ordered = diff.assign(_g=group).sort_values(["_g"], kind="stable").drop(columns="_g")
    return [dash.html.P(summary, id="compare-summary",
                        className="tt-regressions" if len(regressions) else "tt-no-regressions"),
            dash.html.P(detectable, id="compare-detectable"),
            explained("Changes", EXPLAIN["compare"], graph(change_figure(diff), "compare-changes"),
                      table(ordered[_TABLE_COLUMNS], "compare-table", page_size=40, highlight="regression"))]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    try:
        base = _default_base(src, q)
    except ValueError:
        base = None
    return [run_picker(src, base, name="base", label="Baseline"), run_picker(src, q.run, label="Candidate")]


def layout(**query: str) -> Any:
    return page(PATH, "Compare runs", query, body, controls)


live_callback(PATH, body)
