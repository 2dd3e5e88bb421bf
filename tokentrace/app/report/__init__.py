"""``tokentrace report``: a run's analyses as Markdown, HTML, JSON and JUnit, gated by budgets.

Use::

    from tokentrace.app.report import make_report, render

    report = make_report("stores/ci", baseline="stores/main:run-42", budget_file="tokentrace.toml")
    print(render(report, "md"))
    raise SystemExit(0 if report.passed else 1)

Parts: :mod:`~tokentrace.app.report.inputs` (open and check runs),
:mod:`~tokentrace.app.report.budget` (budget files), :mod:`~tokentrace.app.report.model`
(gather the data from the analyzers, imported lazily), ``render_*`` (formats).
Bad input raises a ``ValueError`` (``StoreError``, ``ReportInputError``,
``BudgetError``) with one sentence. See ``docs/report.md``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

from tokentrace.app.report.budget import Budget, BudgetError, BudgetResult, load_budgets, parse_budgets
from tokentrace.app.report.inputs import ReportInputError, expand_run_ref, open_checked
from tokentrace.app.report.model import Report, build_report

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
        from tokentrace.app.report.render_md import render_markdown
        return render_markdown
    if fmt == "html":
        from tokentrace.app.report.render_html import render_html
        return render_html
    if fmt == "json":
        from tokentrace.app.report.render_json import render_json
        return render_json
    if fmt == "junit":
        from tokentrace.app.report.render_junit import render_junit
        return render_junit
    raise ReportInputError(f"unknown report format {fmt!r}; formats: {', '.join(FORMATS)}")


def render(report: Report, fmt: str) -> str:
    """``report`` as text in format ``fmt`` (``md``, ``html``, ``json`` or ``junit``)."""
    return _renderer(fmt)(report)


def make_report(store: str | os.PathLike[str], run: str | None = None, *,
                baseline: str | Sequence[str] | None = None, candidates: Sequence[str] = (),
                noise: str | Sequence[str] | None = None, budget_file: str | os.PathLike[str] | None = None,
                budgets: tuple[Budget, ...] = (), num_slowest: int = 10, engine: str | None = None,
                spark_master: str | None = None) -> Report:
    """Open, check and analyse run ``run`` of ``store`` (newest by default) and check budgets.

    ``baseline``: ``STORE[:RUN]`` of the run to compare with, or several (runs of one configuration; a RUN
    with ``*`` is every run it matches: ``STORE:*``). ``candidates``: more runs of the candidate configuration
    beside ``run``, the same way (every run counts once, however often it is named). ``noise``: A/A runs (three
    or more of one configuration) whose spread is the run-to-run noise of a side with one run (default: the
    documented figure, ``docs/report.md``). ``budget_file``: a TOML budget file, read before any analysis (its
    budgets follow ``budgets``).
    ``engine``: ``"duckdb"`` (default, embedded) or ``"spark"`` (``spark_master``,
    default ``local[*]``); the same numbers either way (``docs/scaling.md``).
    Raises ``ValueError`` subclasses for bad input. Blocks while reading the store.
    """
    if engine not in (None, "duckdb", "spark"):
        raise ReportInputError(f"unknown engine {engine!r}; engines: duckdb, spark")
    all_budgets = tuple(budgets) + (load_budgets(budget_file) if budget_file is not None else ())
    base_refs = _refs(baseline)
    if any(b.is_regression for b in all_budgets) and not base_refs:
        first = next(b for b in all_budgets if b.is_regression)
        raise BudgetError(f"budget {first.text!r} compares with a baseline run: pass --baseline STORE[:RUN]")
    opened, rows = open_checked(store, run)
    base = _opened(base_refs)
    others = [o for o in _opened(_refs(candidates)) if o[0].path.resolve() != opened.path.resolve()]
    noise_runs = _opened(_refs(noise))
    if noise_runs and len(noise_runs) < 3:
        raise ReportInputError(f"--noise needs at least 3 A/A runs of one configuration, got {len(noise_runs)}")
    options = {"master": spark_master} if engine == "spark" and spark_master else {}
    return build_report(opened, rows, baseline=base or None, candidates=others, noise_runs=noise_runs,
                        budgets=all_budgets, num_slowest=num_slowest, engine=engine, engine_options=options)


def _opened(refs: list[tuple[Path, str | None]]) -> list:
    """Each referenced run opened and checked, once however often it is named (``STORE`` and ``STORE:*``)."""
    seen: dict[Path, tuple] = {}
    for store, run in refs:
        checked = open_checked(store, run)
        seen.setdefault(checked[0].path.resolve(), checked)
    return list(seen.values())


def _refs(refs: str | Sequence[str] | None) -> list[tuple[Path, str | None]]:
    """Run references (``STORE[:RUN]``, patterns expanded) as (store, run) pairs, each run once."""
    if refs is None:
        return []
    pairs = [p for ref in ([refs] if isinstance(refs, str) else refs) for p in expand_run_ref(ref)]
    return list(dict.fromkeys(pairs))
