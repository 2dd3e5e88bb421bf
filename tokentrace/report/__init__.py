"""``tokentrace report``: a run's analyses as Markdown, HTML, JSON and JUnit, gated by budgets.

Use::

    from tokentrace.report import make_report, render

    report = make_report("stores/ci", baseline="stores/main:run-42", budget_file="tokentrace.toml")
    print(render(report, "md"))
    raise SystemExit(0 if report.passed else 1)

Parts: :mod:`~tokentrace.report.inputs` (open and check runs),
:mod:`~tokentrace.report.budget` (budget files), :mod:`~tokentrace.report.model`
(gather the data from the analyzers, imported lazily), ``render_*`` (formats).
Bad input raises a ``ValueError`` (``StoreError``, ``ReportInputError``,
``BudgetError``) with one sentence. See ``docs/report.md``.
"""

from __future__ import annotations

import os
from typing import Callable

from tokentrace.report.budget import Budget, BudgetError, BudgetResult, load_budgets, parse_budgets
from tokentrace.report.inputs import ReportInputError, open_checked, split_run_ref
from tokentrace.report.model import Report, build_report

__all__ = [
    "FORMATS",
    "FILE_NAMES",
    "Budget",
    "BudgetError",
    "BudgetResult",
    "Report",
    "ReportInputError",
    "load_budgets",
    "parse_budgets",
    "make_report",
    "render",
]

FILE_NAMES: dict[str, str] = {"md": "report.md", "html": "report.html", "json": "report.json",
                              "junit": "junit.xml"}
"""Output file per format when the report is written to a folder."""
FORMATS: tuple[str, ...] = tuple(FILE_NAMES)


def _renderer(fmt: str) -> Callable[[Report], str]:
    if fmt == "md":
        from tokentrace.report.render_md import render_markdown
        return render_markdown
    if fmt == "html":
        from tokentrace.report.render_html import render_html
        return render_html
    if fmt == "json":
        from tokentrace.report.render_json import render_json
        return render_json
    if fmt == "junit":
        from tokentrace.report.render_junit import render_junit
        return render_junit
    raise ReportInputError(f"unknown report format {fmt!r}; formats: {', '.join(FORMATS)}")


def render(report: Report, fmt: str) -> str:
    """``report`` as text in format ``fmt`` (``md``, ``html``, ``json`` or ``junit``)."""
    return _renderer(fmt)(report)


def make_report(store: str | os.PathLike[str], run: str | None = None, *, baseline: str | None = None,
                budget_file: str | os.PathLike[str] | None = None, budgets: tuple[Budget, ...] = (),
                num_slowest: int = 10, engine: str | None = None, spark_master: str | None = None) -> Report:
    """Open, check and analyse run ``run`` of ``store`` (newest by default) and check budgets.

    ``baseline``: ``STORE[:RUN]`` of the run to compare with. ``budget_file``: a
    TOML budget file, read before any analysis (its budgets follow ``budgets``).
    ``engine``: ``"duckdb"`` (default, embedded) or ``"spark"`` (``spark_master``,
    default ``local[*]``); the same numbers either way (``docs/scaling.md``).
    Raises ``ValueError`` subclasses for bad input. Blocks while reading the store.
    """
    if engine not in (None, "duckdb", "spark"):
        raise ReportInputError(f"unknown engine {engine!r}; engines: duckdb, spark")
    all_budgets = tuple(budgets) + (load_budgets(budget_file) if budget_file is not None else ())
    if any(b.is_regression for b in all_budgets) and baseline is None:
        first = next(b for b in all_budgets if b.is_regression)
        raise BudgetError(f"budget {first.text!r} compares with a baseline run: pass --baseline STORE[:RUN]")
    opened, rows = open_checked(store, run)
    base = None
    if baseline is not None:
        base_store, base_run = split_run_ref(baseline)
        base = open_checked(base_store, base_run)
    options = {"master": spark_master} if engine == "spark" and spark_master else {}
    return build_report(opened, rows, baseline=base, budgets=all_budgets, num_slowest=num_slowest,
                        engine=engine, engine_options=options)
