"""The report as GitHub-flavoured Markdown, fit for a CI job summary (``$GITHUB_STEP_SUMMARY``).

Order: the title, then the report's first lines (the load verdict: saturated or
not, and which pool; the instance advice; the attribution invariant), the run
header, budgets verdict, regressions against the baseline, then every section
with its sentence and tables, then the flat metrics in a collapsed block. Pure
function of a :class:`Report`.
"""

from __future__ import annotations

import pandas as pd

from tokentrace.app.report.budget import format_value
from tokentrace.app.report.frames import frame_cells
from tokentrace.app.report.model import Report, RunHeader
from tokentrace.app.report.render_names import column_label, for_people, instance_labels
from tokentrace.app.report.sections import Section
from tokentrace.schema import REQUESTS, SPANS, TOKENS

__all__ = ["render_markdown", "markdown_table"]

_MAX_ROWS = 50  # rows per table in Markdown; the JSON report has all of them


_MARKUP = str.maketrans({"\\": "\\\\", "|": "\\|", "[": "\\[", "]": "\\]",
                         "&": "&amp;", "<": "&lt;", ">": "&gt;", "\n": " ", "\r": " "})
"""What the report's own text and every name in it may not carry into Markdown: HTML (``<``, ``>``, ``&``
become entities, so a viewer that renders HTML shows a hostile tenant name instead of running it), links
(brackets are escaped), table cell ends (``|``, newlines). Backticks stay: a code span shows HTML, never
renders it."""


def _escape(text: str) -> str:
    """``text`` as literal Markdown text: no HTML, link or table cell end can come of it."""
    return str(text).translate(_MARKUP)


def _code(text: str) -> str:
    """``text`` as a code span (HTML inside one is shown, never rendered); backticks and newlines cannot end it
    and ``|`` cannot end a table cell."""
    return "`" + str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ").replace("\r", " ") + "`"


def markdown_table(df: pd.DataFrame, *, max_rows: int = _MAX_ROWS, names: dict[int, str] | None = None) -> str:
    """``df`` as a pipe table (numbers right-aligned, readable headers with units, instances by name: ``names``
    maps instance ids to names), at most ``max_rows`` rows."""
    df = for_people(df, names or {})
    headers, rows = frame_cells(df.head(max_rows))
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in df.columns]
    lines = ["| " + " | ".join(_escape(column_label(h)) for h in headers) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in rows]
    if len(df) > max_rows:
        lines.append(f"\n_{len(df) - max_rows} more row(s) in the JSON report._")
    return "\n".join(lines)


def _first_lines(report: Report) -> list[str]:
    """The headline sentences, the SLO verdict and the load verdict in bold."""
    verdicts = {report.diagnosis.get("verdict"), report.load.get("verdict")} - {None}
    return [x for line in report.headline for x in ((f"**{_escape(line)}**" if line in verdicts else _escape(line)), "")]


def _header(run: RunHeader, baseline: RunHeader | None, num_requests: object = None) -> list[str]:
    rows = run.rows
    names = sorted(instance_labels(list(run.instances)).values())
    requests = (f"{int(num_requests):,} requests ("
                if isinstance(num_requests, (int, float)) and num_requests == num_requests else "(")
    lines = [f"- store: {_code(run.path)}",
             f"- created: {_escape(run.created or '-')}; tokentrace {_escape(run.tokentrace_version or '-')}",
             f"- {requests}{rows.get(REQUESTS.name, 0):,} request rows, {rows.get(TOKENS.name, 0):,} token rows, "
             f"{rows.get(SPANS.name, 0):,} span rows) from {len(names)} traced process(es): "
             + (", ".join(_escape(n) for n in names) or "-")]
    if baseline is not None:
        lines.append(f"- baseline: run {_code(baseline.run_id)} in {_code(baseline.path)}")
    return lines + [""]


def _budgets(report: Report) -> list[str]:
    if not report.budgets:
        return ["## Budgets", "", "No budgets were checked (--budget FILE).", ""]
    failed = [r for r in report.budgets if not r.passed]
    verdict = (f"**FAILED**: {len(failed)} of {len(report.budgets)} budget(s) violated." if failed
               else f"**PASSED**: all {len(report.budgets)} budget(s) hold.")
    lines = ["## Budgets", "", verdict, "", "| | budget | measured | detail |", "|---|---|---:|---|"]
    for r in report.budgets:
        mark = "✅" if r.passed else "❌"
        lines.append(f"| {mark} | {_code(r.budget.text)} | {_escape(format_value(r.actual, r.budget.kind))} | "
                     f"{_escape(r.message)} |")
    return lines + [""]


def _regressions(report: Report) -> list[str]:
    if report.baseline is None:
        return []
    if not report.regressions:
        return ["## Regressions", "", f"No regression against run {_code(report.baseline.run_id)} past run-to-run "
                                      "noise.", ""]
    lines = ["## Regressions", "", f"Regressions against run {_code(report.baseline.run_id)} past run-to-run noise, "
                                   "latency first, then stages by the time they added:", ""]
    return lines + [f"- ⚠️ {_escape(r)}" for r in report.regressions] + [""]


def _section(s: Section, names: dict[int, str]) -> list[str]:
    lines = [f"## {_escape(s.title)}", ""]
    if s.note:
        lines += [_escape(s.note), ""]
    for caption, df in s.tables:
        if caption:
            lines += [f"**{_escape(caption)}**", ""]
        lines += [markdown_table(df, names=names), ""]
    return lines


def _metrics(report: Report) -> list[str]:
    shown = {k: v for k, v in report.metrics.items() if not (k.startswith("stage.") and v == 0)}
    left_out = len(report.metrics) - len(shown)
    df = pd.DataFrame({"metric": list(shown), "value": list(shown.values())})
    return ["<details><summary>All metrics (names usable in budgets)</summary>", "",
            f"{left_out} stage share(s) that are 0 are left out here; the JSON report lists every metric. "
            "A metric shown as - was not measured.", "",
            markdown_table(df, max_rows=len(df) or 1), "", "</details>", ""]


def render_markdown(report: Report) -> str:
    """The whole report as one Markdown document (ends with a newline)."""
    lines = ([f"# tokentrace report: run {_code(report.run.run_id)}", ""] + _first_lines(report)
             + _header(report.run, report.baseline, report.load.get("num_requests")) + _budgets(report)
             + _regressions(report))
    names = instance_labels(list(report.run.instances))
    for s in report.sections:
        if s.key == "diff" and report.baseline is None:
            continue
        lines += _section(s, names)
    lines += _metrics(report)
    return "\n".join(lines).rstrip() + "\n"
