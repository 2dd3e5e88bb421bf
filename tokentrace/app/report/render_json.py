"""The report as JSON for machines. The keys are stable; ``docs/report.md`` documents them.

Top level::

    format        "tokentrace-report"
    version       2 (bumped on an incompatible change; 2: ids are strings)
    passed        true when every budget holds
    headline      ["<SLO verdict>", "Why #1: <cause> ...", ..., "<load verdict>", "<instance advice>",
                   "<attribution>"]: the report's first lines
    diagnosis     {verdict, num_judged, num_missed, causes: [{cause, share, ms, num_first, num_requests, fix,
                   evidence, stage?, tenant?}]}: whether served requests met their SLO targets and why not,
                   causes ranked by the share of the missed time they explain (docs/diagnosis.md)
    load          {offered_rps, served_rps, saturated, pool, stage, arrival_window_s, num_requests,
                   num_completed, load_ratio, verdict}: offered load over the arrival window against
                   served load; saturated is true, false or null (not judged)
    run           {run_id, path, created, tokentrace_version, rows, instances, instance_names, counters}
    baseline      the same for the baseline run, or null
    metrics       {name: number | null}: the budget namespace (ms, fractions, req/s, counts)
    budgets       [{budget, metric, op, limit, kind, actual, baseline, passed, message}]
    regressions   ["itl p99: 6.000 ms -> 12.100 ms (+101.7%)", ...]
    diff          [rows of the diff analyzer] or null
    sections      {key: {title, note, tables: [{caption, columns, rows}]}}

Numbers that are not finite (NaN, inf) are written as null; table rows are
objects keyed by column name. The tables are the other formats' tables: an
instance is named (column ``instance``, ``prefill-0``), a request by its key.
Ids that remain (the run's ``instances``, their writers) are strings: a 63-bit
integer does not survive a JavaScript JSON parser (its numbers are doubles).
``instance_names`` maps each instance id to its name.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from tokentrace.app.report.model import Report, RunHeader
from tokentrace.app.report.render_names import ID_COLUMNS, for_people, id_text, instance_labels

__all__ = ["FORMAT", "VERSION", "report_dict", "render_json"]

FORMAT = "tokentrace-report"
VERSION = 2
_ID_KEYS = frozenset({"instance", "writer", *ID_COLUMNS})  # manifest keys and table columns holding ids


def _plain(value: Any) -> Any:
    """A JSON-ready scalar: numpy types unwrapped, NaN/inf and pandas NA as None."""
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value if isinstance(value, str) else str(value)


def _value(key: str, value: Any) -> Any:
    """``_plain(value)``, an id as a string."""
    if key in _ID_KEYS and isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return id_text(value)
    return _plain(value)


def _rows(df: pd.DataFrame) -> list[dict[str, Any]]:
    columns = [str(c) for c in df.columns]
    return [{c: _value(c, v) for c, v in zip(columns, row)} for row in df.itertuples(index=False, name=None)]


def _header(h: RunHeader | None) -> dict[str, Any] | None:
    if h is None:
        return None
    names = instance_labels(list(h.instances))
    return {"run_id": h.run_id, "path": h.path, "created": h.created, "tokentrace_version": h.tokentrace_version,
            "rows": dict(h.rows), "instances": [{k: _value(k, v) for k, v in i.items()} for i in h.instances],
            "instance_names": {id_text(k): v for k, v in names.items()}, "counters": dict(h.counters)}


def report_dict(report: Report) -> dict[str, Any]:
    """The report as plain dicts and lists (what :func:`render_json` serializes)."""
    budgets = [{"budget": r.budget.text, "metric": r.budget.metric, "op": r.budget.op,
                "limit": _plain(r.budget.limit), "kind": r.budget.kind.value, "actual": _plain(r.actual),
                "baseline": _plain(r.baseline), "passed": r.passed, "message": r.message} for r in report.budgets]
    names = instance_labels(list(report.run.instances))
    shown = [(s, [(c, for_people(df, names)) for c, df in s.tables]) for s in report.sections]
    sections = {s.key: {"title": s.title, "note": s.note,
                        "tables": [{"caption": c, "columns": [str(x) for x in df.columns], "rows": _rows(df)}
                                   for c, df in tables]}
                for s, tables in shown}
    return {
        "format": FORMAT,
        "version": VERSION,
        "passed": report.passed,
        "headline": list(report.headline),
        "load": {k: _plain(v) for k, v in report.load.items()},
        "diagnosis": {k: ([{ck: _plain(cv) for ck, cv in c.items()} for c in v] if k == "causes" else _plain(v))
                      for k, v in report.diagnosis.items()},
        "run": _header(report.run),
        "baseline": _header(report.baseline),
        "metrics": {k: _plain(v) for k, v in report.metrics.items()},
        "budgets": budgets,
        "regressions": list(report.regressions),
        "diff": None if report.diff is None else _rows(report.diff),
        "sections": sections,
    }


def render_json(report: Report) -> str:
    """The report as an indented JSON document (ends with a newline); strict JSON, no NaN."""
    return json.dumps(report_dict(report), indent=2, allow_nan=False) + "\n"
