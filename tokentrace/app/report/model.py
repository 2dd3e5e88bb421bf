"""The report's data: everything the renderers show, gathered once from a run's analyzers.

:func:`build_report` opens nothing itself: it takes an opened (and checked) run,
asks the analyzers (``analyzers.analysis.RunAnalysis``, imported when a report
is built so ``tokentrace --help`` stays fast), flattens the
numbers budgets can address into :attr:`Report.metrics`, compares with a
baseline run if one is given, and checks the budgets. Renderers
(``render_md``, ``render_html``, ``render_json``, ``render_junit``) only format
a :class:`Report`.

Metric names (the budget namespace, values in ms for times, fractions for shares):
``<ttft|tpot|itl|e2e>.<mean|p50|p90|p99|p99.9>``,
``stage.<stage>.<share_of_ttft|share_of_itl|tail_share_of_ttft|tail_share_of_itl>``,
``unattributed.share`` (signed), ``overlap.share``, ``slo.<class>.attainment``, ``slo.<class>.fluidity``
(class ``all`` = every request, ``none`` = requests without a class), ``goodput.rps``, ``counters.<name>`` and,
when the run speculated, ``spec.<acceptance_rate|draft_share_of_decode|rejected_draft_share|ms_per_token|mean_itl>``,
and when it had sessions, ``session.<reuse_fraction|lost_tokens|extra_prefill_ms|load_ms|ttft_sum.mean|ttft_sum.p90|
think.mean>`` (:mod:`tokentrace.app.report.sessions`).
A metric the run did not measure is NaN (``null`` in JSON), never 0: a budget on it fails.

The report's first lines (:attr:`Report.headline`) answer "why" before "how loaded": the SLO
verdict (how many served requests missed a target, :func:`analyzers.diagnosis.diagnose`), the
causes ranked by the share of the missed time they explain, each with its fix (worded by
:mod:`tokentrace.app.report.diagnosis`), then the load verdict (offered against served load, saturated
or not and where: :func:`analyzers.load.load`), the prefill:decode instance advice (never "enough
instances" while a target is missed) and the attribution invariant's two figures, worded by
:mod:`tokentrace.app.report.headline`. :attr:`Report.load` holds the load verdict's numbers (the JSON
report's ``load`` object), :attr:`Report.diagnosis` the SLO verdict and the ranked causes (its
``diagnosis`` object).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import pandas as pd

from tokentrace.app.report.budget import Budget, BudgetError, BudgetResult, Change, evaluate
from tokentrace.app.report.diagnosis import cause_lines, causes_json, slo_verdict
from tokentrace.app.report.headline import advice_sentence, attribution_sentence, load_sentence
from tokentrace.app.report.sections import SECTION_BUILDERS, Context, Section, stage_shares
from tokentrace.app.report.sessions import session_comparison, session_metrics
from tokentrace.app.report.speculative import spec_metrics
from tokentrace.app.report.whatif import whatif_section
from tokentrace.schema import SPANS, SPEC_STEPS, STEPS, col
from tokentrace.store.manifest import DROPPED, SAMPLED_OUT

__all__ = ["RunHeader", "Charts", "Report", "build_report", "run_metrics", "metric_changes", "load_summary",
           "diagnosis_summary",
           "ALL_CLASSES", "LOAD_KEYS"]

ALL_CLASSES = "all"
"""Metric name part standing for every SLO class (the analyzers' ``*`` row)."""
NO_CLASS = "none"
"""Metric name part standing for requests without an SLO class."""
_LATENCY_STATS = {"mean_ms": "mean", "p50_ms": "p50", "p90_ms": "p90", "p99_ms": "p99", "p99.9_ms": "p99.9"}
_STAGE_STATS = {"ttft_share": "share_of_ttft", "itl_share": "share_of_itl",
                "ttft_tail_share": "tail_share_of_ttft", "itl_tail_share": "tail_share_of_itl"}
LOAD_KEYS: dict[str, str] = {
    "offered_rps": "offered_rps", "served_rps": "served_rps", "saturated": "saturated", "pool": "saturated_pool",
    "stage": "saturated_stage", "arrival_window_s": "arrival_window_s", "num_requests": "num_requests",
    "num_completed": "num_completed", "load_ratio": "load_ratio",
}
"""Keys of :attr:`Report.load` (the JSON report's ``load``) and the load analyzer's summary column each holds."""
_NUM_BUCKETS = 60  # time-series points across a run in the HTML charts
_MIN_BUCKET_S = 1e-3


@dataclass(frozen=True, slots=True, eq=False)
class RunHeader:
    """Who the run is: id, where, when, with what, and how much it holds."""

    run_id: str
    path: str
    created: str | None  # ISO 8601 UTC
    tokentrace_version: str | None
    rows: dict[str, int]  # rows per store table
    instances: tuple[dict[str, Any], ...]  # from the manifest: instance, role, name, pid, host
    counters: dict[str, int]  # summed over writers: dropped, sampled_out, ...


@dataclass(frozen=True, slots=True, eq=False)
class Charts:
    """Data behind the HTML report's charts (empty frames when the run lacks the tables)."""

    latency: pd.DataFrame  # latency summary: metric, count, mean_ms, p50_ms ... p99.9_ms
    breakdown: pd.DataFrame  # stage breakdown, stages that took time
    windows: pd.DataFrame  # latency per time window: window_start_s, metric, p50_ms, p99_ms, ...
    queues: pd.DataFrame  # queue timeline: instance, t_s, waiting, running, preempted
    speculation: Any = None  # analyzers.speculative.SpecReport when the run speculated, else None


@dataclass(frozen=True, slots=True, eq=False)
class Report:
    """A run's report: header, sections, flat metrics, baseline diff and budget verdicts."""

    run: RunHeader
    baseline: RunHeader | None
    sections: tuple[Section, ...]
    metrics: dict[str, float]
    diff: pd.DataFrame | None  # the comparison's rows (analyzers.compare), None without a baseline
    regressions: tuple[str, ...]  # significant regressions, e.g. "itl p99: 6.0 ms -> 12.1 ms (+101.7%)"
    budgets: tuple[BudgetResult, ...]
    charts: Charts
    headline: tuple[str, ...] = ()  # the first lines: SLO verdict, causes, load verdict, instance advice, attribution
    load: dict[str, Any] = field(default_factory=dict)  # the verdict's numbers (LOAD_KEYS) and sentence ("verdict")
    diagnosis: dict[str, Any] = field(default_factory=dict)  # verdict, num_judged, num_missed, causes (ranked)

    @property
    def passed(self) -> bool:
        """True when every budget holds (and vacuously with no budgets)."""
        return all(r.passed for r in self.budgets)

    def section(self, key: str) -> Section:
        for s in self.sections:
            if s.key == key:
                return s
        raise KeyError(f"report has no section {key!r}")


def _header(run: Any, rows: dict[str, int]) -> RunHeader:
    manifest = run.manifest
    return RunHeader(run_id=run.run_id, path=str(run.path), created=manifest.get("created"),
                     tokentrace_version=manifest.get("tokentrace_version"), rows=dict(rows),
                     instances=tuple(run.instances()), counters=dict(run.counters()))


def _analysis(run: Any, engine: str | None = None, engine_options: Mapping[str, Any] | None = None) -> Any:
    """The run's analyses, ``analyzers.analysis.RunAnalysis`` (imported when a report is built), on ``engine``
    (``"duckdb"``, the default, or ``"spark"``; ``engine_options`` e.g. Spark's ``master``)."""
    from analyzers.analysis import RunAnalysis
    from analyzers.engine import open_engine

    return RunAnalysis(run, engine=open_engine(engine, **dict(engine_options or {})))


def _run_list(baseline: RunRows | Sequence[RunRows] | None) -> list[RunRows]:
    if baseline is None:
        return []
    if len(baseline) == 2 and isinstance(baseline[1], dict):
        return [baseline]  # type: ignore[list-item]
    return list(baseline)  # type: ignore[arg-type]


def _noise(noise_runs: Sequence[RunRows], engine: str | None, engine_options: Mapping[str, Any] | None) -> Any:
    """The run-to-run noise measured from A/A runs, or None (the comparison's documented default)."""
    if not noise_runs:
        return None
    analyses = [_analysis(r, engine, engine_options) for r, _ in noise_runs]
    where = sorted({str(r.path.parent) for r, _ in noise_runs})
    return analyses[0].noise(analyses[1:], source=f"{len(analyses)} A/A runs in {', '.join(where)}")


def _class_name(value: Any) -> str:
    if value == "*":
        return ALL_CLASSES
    return NO_CLASS if value is None or value == "" else str(value)


def run_metrics(ctx: Context, counters: dict[str, int]) -> dict[str, float]:
    """The flat metric namespace budgets address (see the module docstring)."""
    out: dict[str, float] = {}
    if ctx.has("latency"):
        for _, r in ctx.get("latency").iterrows():
            for column, stat in _LATENCY_STATS.items():
                if column in r.index:
                    out[f"{r['metric']}.{stat}"] = float(r[column])
    if ctx.has("stage_breakdown"):
        for _, r in ctx.get("stage_breakdown").iterrows():
            for column, stat in _STAGE_STATS.items():
                out[f"stage.{r['stage']}.{stat}"] = float(r[column])
    if ctx.has("unattributed_share"):
        out["unattributed.share"] = float(ctx.get("unattributed_share"))
    if ctx.has("overlap_share"):
        out["overlap.share"] = float(ctx.get("overlap_share"))
    for method, column, stat in (("slo", "attainment", "attainment"), ("fluidity", "fluidity_index", "fluidity")):
        if ctx.has(method):
            for _, r in ctx.get(method).iterrows():
                out[f"slo.{_class_name(r[col.SLO_CLASS])}.{stat}"] = float(r[column])
    if ctx.has("goodput"):
        g = ctx.get("goodput")
        overall = g[g[col.SLO_CLASS] == "*"]
        if len(overall):
            out["goodput.rps"] = float(overall["goodput_rps"].iloc[0])
    if ctx.has("speculation") and ctx.rows.get(SPEC_STEPS.name, 0):
        out.update(spec_metrics(ctx.get("speculation")))
    if ctx.has("sessions"):
        out.update(session_metrics(ctx.get("sessions")))
    for name, value in counters.items():
        out[f"counters.{name}"] = float(value)
    return out


def metric_changes(metrics: dict[str, float], baseline: dict[str, float],
                   diff: pd.DataFrame | None) -> dict[str, Change]:
    """Every metric of both runs as a :class:`Change`; latency statistics take their significance from the
    comparison's verdict (a change past run-to-run noise) when it has a row for them."""
    changes = {k: Change(baseline[k], v) for k, v in metrics.items() if k in baseline}
    if diff is not None:
        for _, r in diff.iterrows():
            key = f"{r['metric']}.{r['statistic']}"
            if key in changes:
                changes[key] = Change(changes[key].baseline, changes[key].candidate, bool(r["significant"]))
    return changes


def _runs(r: pd.Series) -> str:
    return f"{int(r['runs_baseline'])} / {int(r['runs_candidate'])} run(s)"


def _change_text(r: pd.Series) -> str:
    rel = f", {r['rel_change'] * 100:+.1f}%" if pd.notna(r["rel_change"]) else ""
    return (f"{r['metric']} {r['statistic']}: {r['baseline']:.3f} ms -> {r['candidate']:.3f} ms "
            f"({r['delta']:+.3f} ms{rel}; p = {r['p_adjusted']:.2g}, {_runs(r)}, run-to-run noise "
            f"{r['noise'] * 100:.0f}%)")


def _ordered(diff: pd.DataFrame) -> pd.DataFrame:
    """Latency rows first (in the comparison's order), then stage rows by how much time they added, then context."""
    metric = diff["metric"].astype(str)
    group = metric.str.startswith("stage.").astype(int) + 2 * (diff["unit"] != "ms").astype(int)
    order = group * 1e12 - diff["delta"].astype(float).fillna(0).where(group == 1, 0.0)
    return diff.assign(_order=order).sort_values("_order", kind="stable").drop(columns="_order")


def _regressions(diff: pd.DataFrame | None) -> tuple[str, ...]:
    """Significant regressions: latency metrics first, then stages by the time they added."""
    if diff is None or len(diff) == 0:
        return ()
    return tuple(_change_text(r) for _, r in _ordered(diff[diff["regression"].astype(bool)]).iterrows())


_NOISE_SHOWN = ["metric", "statistic", "unit", "baseline", "candidate", "rel_change", "noise", "min_detectable",
                "runs_needed"]


def _sizes_sentence(diff: pd.DataFrame) -> str:
    """What this many runs per side can detect: the smallest detectable change of the latency means."""
    means = diff[(diff["unit"] == "ms") & (diff["statistic"] == "mean") & ~diff["metric"].str.startswith("stage.")]
    means = means[means["min_detectable"].notna()]
    if not len(means):
        return ""
    parts = ", ".join(f"{r['metric']} {r['min_detectable'] * 100:.0f}%" for _, r in means.iterrows())
    return (f" At this size the smallest change detected with 90% power is: {parts} (column min_detectable "
            "per row); a row whose change stayed within noise says how many runs per side would detect it "
            "(runs_needed).")


def _diff_section(diff: pd.DataFrame | None, regressions: tuple[str, ...], baseline: RunHeader | None) -> Section:
    title = "Difference from the baseline"
    if baseline is None:
        return Section("diff", title, "No baseline run was given (--baseline STORE[:RUN]).")
    if diff is None or not len(diff):
        return Section("diff", title, "Not available: this tokentrace build has no comparison analyzer.")
    from analyzers.compare import explain

    first = diff.iloc[0]
    note = (f"Against run {baseline.run_id}: {_runs(first)} per side (baseline / candidate), "
            f"{len(regressions)} regression(s). Each run counts once: a change is significant when it is past "
            f"what run-to-run noise produces (noise from {first['noise_source']}), Holm-adjusted p under 0.05 "
            "within each family (primary: TTFT, ITL and E2E p50 and p99; other latency statistics; stages; "
            "context), at least 0.1 ms and 2%."
            + _sizes_sentence(diff))
    why = explain(diff)
    if why:
        note += " " + "; ".join(why) + "."
    shown = _ordered(diff[diff["significant"].astype(bool)])
    within = diff[(diff["verdict"] == "noise") & (diff["rel_change"].abs() >= 0.1)]
    tables = []
    if len(shown):
        tables.append(("Significant changes: latency, then stages by the time they added, then context", shown))
    if len(within):
        tables.append(("Not distinguishable from run-to-run noise (changes of 10% or more)",
                       _ordered(within)[_NOISE_SHOWN]))
    return Section("diff", title, note, tuple(tables))


def _counters_section(counters: dict[str, int]) -> Section:
    dropped = {k: v for k, v in counters.items() if k.startswith(DROPPED) or k in (SAMPLED_OUT, "sink_errors")}
    df = pd.DataFrame({"counter": list(dropped), "value": list(dropped.values())})
    total = counters.get(DROPPED, 0)
    note = ("No event was dropped." if total == 0 else
            f"{total:,} event(s) were dropped by the recorder: the run's figures miss them.")
    return Section("counters", "Dropped and sampled-out events", note, (("", df),))


def _charts(ctx: Context, header: RunHeader) -> Charts:
    empty = pd.DataFrame()
    latency = ctx.get("latency") if ctx.has("latency") else empty
    breakdown = (stage_shares(ctx.get("stage_breakdown"))
                 if ctx.has("stage_breakdown") and header.rows.get(SPANS.name, 0) else empty)
    windows = ctx.get("latency", window_s=ctx.bucket_s) if ctx.has("latency") else empty
    queues = (ctx.get("queues", bucket_s=ctx.bucket_s).timeline
              if ctx.has("queues") and header.rows.get(STEPS.name, 0) else empty)
    speculation = (ctx.get("speculation")
                   if ctx.has("speculation") and header.rows.get(SPEC_STEPS.name, 0) else None)
    return Charts(latency=latency, breakdown=breakdown, windows=windows, queues=queues, speculation=speculation)


def load_summary(ctx: Context) -> dict[str, Any]:
    """The load verdict's numbers (:data:`LOAD_KEYS`) and its sentence, from the load analyzer (computed once)."""
    if not ctx.has("load"):
        return {**{k: None for k in LOAD_KEYS}, "verdict": "Load not judged: this build has no load analyzer."}
    report = ctx.get("load")
    row = report.row
    out: dict[str, Any] = {}
    for key, column in LOAD_KEYS.items():
        value = row.get(column)
        out[key] = None if value is None or (isinstance(value, float) and math.isnan(value)) else value
    out["verdict"] = load_sentence(row, report.pools, report.stages)
    return out


NO_SERVER_LANE = ("The run has client rows only, no server lane: the latencies are the client's own measurements, "
                  "and no stage breakdown is possible. Trace the server too: tokentrace run for the reference "
                  "server, the ASGI middleware and tokentrace.instrument() for your own (docs/instrumenting.md).")


def diagnosis_summary(ctx: Context) -> dict[str, Any]:
    """The SLO verdict, its counts, the first screen's cause lines and every cause ranked by the share of the
    missed time it explains (the JSON report's ``diagnosis``); empty without the analyzer."""
    if not ctx.has("diagnosis"):
        return {}
    d = ctx.get("diagnosis")
    return {"verdict": slo_verdict(d), "num_judged": int(d.num_judged), "num_missed": int(d.num_missed),
            "lines": cause_lines(d), "causes": causes_json(d)}


def _headline(ctx: Context, load: dict[str, Any], diagnosis: dict[str, Any]) -> tuple[str, ...]:
    """The report's first lines: SLO verdict and its causes, load verdict, instance advice, attribution."""
    lines = [diagnosis["verdict"], *diagnosis["lines"]] if diagnosis else []
    lines.append(load["verdict"])
    if ctx.analysis.source.client_lane_only:
        lines.append(NO_SERVER_LANE)
    if ctx.has("pd_ratio") and ctx.rows.get(STEPS.name, 0):
        p = ctx.get("pd_ratio")
        lines.append(advice_sentence(p.recommendation, p.demand, slo_missed=bool(diagnosis.get("num_missed"))))
    if ctx.has("attribution") and ctx.rows.get(SPANS.name, 0):
        lines.append(attribution_sentence(ctx.get("attribution")))
    return tuple(lines)


def _bucket_s(ctx: Context) -> float:
    """Time-series bucket: the run's duration (goodput analyzer) over _NUM_BUCKETS, at least 1 ms."""
    if not ctx.has("goodput"):
        return 1.0
    g = ctx.get("goodput")
    duration = float(g["duration_s"].max()) if len(g) else math.nan
    return max(duration / _NUM_BUCKETS, _MIN_BUCKET_S) if math.isfinite(duration) and duration > 0 else 1.0


RunRows = tuple[Any, dict[str, int]]
"""An opened run and its rows per table."""


def build_report(run: Any, rows: dict[str, int], *, baseline: RunRows | Sequence[RunRows] | None = None,
                 candidates: Sequence[RunRows] = (), noise_runs: Sequence[RunRows] = (),
                 budgets: Sequence[Budget] = (), num_slowest: int = 10, engine: str | None = None,
                 engine_options: Mapping[str, Any] | None = None) -> Report:
    """Gather the report of ``run`` (an opened ``Run``; ``rows``: its rows per table).

    ``engine`` / ``engine_options``: what the analyses run on (``analyzers.engine.open_engine``); the
    baseline runs on the same.

    ``baseline``: (run, rows) of the run to compare with, or a sequence of them (runs of one configuration);
    ``candidates``: more runs of the candidate's configuration beside ``run``; ``noise_runs``: A/A runs (at least
    three of one configuration) whose spread is the run-to-run noise of a side with one run (default: the
    documented one). Budgets and the header compare with the first baseline run; the comparison
    (:attr:`Report.diff`, ``analyzers.compare``) uses every run. Raises ``BudgetError``
    before any analysis when a regression budget has no baseline. Runs on the
    caller's thread; blocks while the analyzers read the store.
    """
    needs = [b.text for b in budgets if b.is_regression]
    bases = _run_list(baseline)
    if needs and not bases:
        raise BudgetError(f"budget {needs[0]!r} compares with a baseline run: pass --baseline STORE[:RUN]")
    header = _header(run, rows)
    ctx = Context(_analysis(run, engine, engine_options), rows, num_slowest=num_slowest)
    ctx.bucket_s = _bucket_s(ctx)
    sections = [build(ctx) for build in SECTION_BUILDERS]
    sections.append(whatif_section(ctx))
    metrics = run_metrics(ctx, header.counters)
    diff, base_header, changes = None, None, None
    if bases:
        base_run, base_rows = bases[0]
        base_header = _header(base_run, base_rows)
        base_ctx = Context(_analysis(base_run, engine, engine_options), base_rows)
        if ctx.has("compare"):
            others = [_analysis(r, engine, engine_options) for r, _ in bases[1:]]
            noise = _noise(noise_runs, engine, engine_options)
            diff = ctx.analysis.compare([base_ctx.analysis] + others,
                                        others=[_analysis(r, engine, engine_options) for r, _ in candidates],
                                        noise=noise)
        base_metrics = run_metrics(base_ctx, base_header.counters)
        changes = metric_changes(metrics, base_metrics, diff)
        compared = session_comparison(metrics, base_metrics)
        if len(compared):  # e.g. two KV retention policies, run against run
            sections.append(Section("sessions_diff", f"Sessions against the baseline ({base_header.run_id})",
                                    "Cross-turn reuse and what lost KV cost, baseline and this run.",
                                    (("Session metrics", compared),)))
    regressions = _regressions(diff)
    sections.append(_diff_section(diff, regressions, base_header))
    sections.append(_counters_section(header.counters))
    results = evaluate(tuple(budgets), metrics, changes)
    load = load_summary(ctx)
    diagnosis = diagnosis_summary(ctx)
    return Report(run=header, baseline=base_header, headline=_headline(ctx, load, diagnosis), load=load,
                  diagnosis={k: v for k, v in diagnosis.items() if k != "lines"},
                  sections=tuple(sections), metrics=metrics, diff=diff, regressions=regressions, budgets=results,
                  charts=_charts(ctx, header))

