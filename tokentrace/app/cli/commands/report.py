"""``tokentrace report``: Markdown / HTML / JSON / JUnit reports of a run, gated by budgets.

Exit codes: 0 when every budget holds (or none was given), 1 when a budget is
violated (the reports are written first), 2 on bad input (a missing or empty
store, an unknown run, a run without requests or tokens, a corrupt file, a
malformed budget file) and when a budget names a metric the run did not measure
(e.g. TPOT attainment of a run without per-token data; the reports are written
first): one sentence on stderr, never a traceback.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer

from tokentrace.app.cli import EXIT_USAGE, check_path, writing_stdout
from tokentrace.app.cli.store_arg import StoreOption, store_of

__all__ = ["register", "report_command", "exit_on_bad_input", "EXIT_VIOLATED", "EXIT_BAD_INPUT"]

EXIT_VIOLATED = 1  # a budget does not hold
EXIT_BAD_INPUT = EXIT_USAGE


@contextlib.contextmanager
def exit_on_bad_input() -> Iterator[None]:
    """Turn bad input into ``error: <sentence>`` on stderr and exit 2; show warnings as one line each.

    Bad input: any ``ValueError`` (``StoreError``, ``ReportInputError``,
    ``BudgetError``), an ``OSError`` (unreadable store, unwritable output) and
    DuckDB's read errors on a damaged Parquet file.
    """
    import duckdb

    def show(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
        typer.echo(f"warning: {message}", err=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        try:
            yield
        except UnicodeError:  # a file name Arrow or DuckDB cannot take
            typer.echo("error: a path given is not valid UTF-8; rename it or give another one", err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except (ValueError, duckdb.IOException, duckdb.InvalidInputException) as err:
            typer.echo(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except OSError as err:
            typer.echo(f"error: {err.filename or 'a file'}: {err.strerror or err}", err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except RuntimeError as err:
            from analyzers.spark_engine import SparkUnavailableError

            if not isinstance(err, SparkUnavailableError):
                raise
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None


def _formats(text: str) -> list[str]:
    from tokentrace.app.report import FORMATS, ReportInputError

    chosen = list(dict.fromkeys(f.strip().lower() for f in text.split(",") if f.strip()))
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen:
        raise ReportInputError(f"unknown report format {', '.join(unknown) or repr(text)}; "
                               f"formats: {', '.join(FORMATS)} (comma-separated)")
    return chosen


def _write_reports(out: Path, texts: dict[str, str]) -> None:
    """Each report into ``out`` whole or not at all (temporary file, then rename; removed on failure)."""
    from tokentrace.app.report import FILE_NAMES, ReportInputError
    from tokentrace.store.layout import atomic_write

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportInputError(f"cannot create the --out folder {out}: {err.strerror or err}") from None
    for f, text in texts.items():
        final = out / FILE_NAMES[f]
        try:
            atomic_write(final, lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"))
        except OSError as err:
            raise ReportInputError(f"cannot write {final}: {err.strerror or err}") from None
        typer.echo(f"wrote {final}", err=True)


def report_command(
    store: Annotated[Optional[Path], typer.Argument(help="Store folder (or one run's folder); --store works too.",
                                                    show_default=False)] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="Run id (default: the newest run).")] = None,
    baseline: Annotated[Optional[list[str]], typer.Option(
        "--baseline", metavar="STORE[:RUN]",
        help="Run to compare with (default run: its newest); repeat it, or write STORE:'*' (every run) or "
             "STORE:'nightly-*', for several runs of the baseline configuration.")] = None,
    candidate: Annotated[Optional[list[str]], typer.Option(
        "--candidate", metavar="STORE[:RUN]",
        help="More runs of the candidate configuration beside the reported run (repeatable; patterns as "
             "--baseline).")] = None,
    noise: Annotated[Optional[list[str]], typer.Option(
        "--noise", metavar="STORE[:RUN]",
        help="A/A runs (3 or more of one configuration) whose spread is the run-to-run noise when a side has "
             "one run (default: the documented figure; see docs/report.md).")] = None,
    budget: Annotated[Optional[Path], typer.Option("--budget", help="TOML budget file (see docs/report.md).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="Comma-separated: md, html, json, junit.")] = "md",
    out: Annotated[Optional[Path], typer.Option("--out", help="Folder to write the reports into "
                                                              "(default: one format to stdout).")] = None,
    slowest: Annotated[int, typer.Option("--slowest", min=1, help="Slowest requests to list.")] = 10,
    engine: Annotated[str, typer.Option("--engine", help="What runs the analyses: duckdb (embedded) or spark "
                                                         "(pip install 'tokentrace[spark]' and a Java runtime).")]
    = "duckdb",
    spark_master: Annotated[str, typer.Option("--spark-master", help="Spark master URL for --engine spark "
                                                                     "(local[*], spark://host:7077, yarn, ...).")]
    = "local[*]",
    store_option: StoreOption = None,
) -> None:
    """Report on a run: latency, SLOs, stage breakdown, queues, cache, tenants, diff; check budgets."""
    store = store_of(store, store_option)
    from tokentrace.app.report import ReportInputError, make_report, render

    check_path(store, "store")
    check_path(budget, "--budget file")
    check_path(out, "--out folder")
    with exit_on_bad_input():
        formats = _formats(fmt)
        if out is None and len(formats) > 1:
            raise ReportInputError(f"--out DIR is needed to write more than one format ({', '.join(formats)})")
        report = make_report(store, run, baseline=baseline or None, candidates=candidate or (), noise=noise or None,
                             budget_file=budget, num_slowest=slowest,
                             engine=engine.strip().lower(), spark_master=spark_master)
        texts = {f: render(report, f) for f in formats}
        if out is None:
            with writing_stdout():
                typer.echo(texts[formats[0]], nl=False)
        else:
            _write_reports(out, texts)
    failed = [r for r in report.budgets if not r.passed]
    unmeasured = [r for r in failed if math.isnan(r.actual)]
    for r in failed:
        if r not in unmeasured:
            typer.echo(f"budget violated: {r.message}", err=True)
    for r in unmeasured:
        typer.echo(f"error: budget {r.budget.text!r} cannot be checked: {r.message}", err=True)
    if unmeasured:
        raise typer.Exit(EXIT_BAD_INPUT)
    if failed:
        raise typer.Exit(EXIT_VIOLATED)


def register(app: typer.Typer) -> None:
    app.command("report")(report_command)
