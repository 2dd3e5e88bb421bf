"""The ``tokentrace`` command line: ``runs`` and ``inspect`` a store (more commands to come).

Each command is a short function registered on :data:`app`; a later issue adds
a command by defining another ``@app.command`` function here (or in a module
that registers on ``app``). Bad input (a path that is not a store, an unknown
run) is reported as one sentence on stderr with exit code 2, never a
traceback: commands wrap store access in :func:`user_errors`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, Iterator, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table as RichTable

from tokentrace.app.cli.errors import EXIT_USAGE, usage_error
from tokentrace.app.cli.store_arg import StoreOption, store_of
from tokentrace.store import DROPPED, SAMPLED_OUT, Run, RunInfo, StoreError, TableInfo, list_runs, open_run

__all__ = ["app", "main", "register_commands", "user_errors", "usage_error", "check_path", "check_reachable",
           "writing_stdout", "stdout_failed", "format_ns",
           "format_bytes", "EXIT_USAGE"]

_PIPE_WIDTH = 120  # columns of output when stdout is not a terminal

app = typer.Typer(
    name="tokentrace",
    help="Token-level latency profiling for LLM serving: inspect and analyze tokentrace stores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: no markup, so "[spark]" in a help text stays as written, and flags show no "<bool>".
    rich_markup_mode=None,
)

StoreArg = Annotated[Optional[Path], typer.Argument(help="Store folder (or one run's folder); --store works too.",
                                                    show_default=False)]


def _version_callback(value: bool) -> None:
    if value:
        from tokentrace.version import __version__

        typer.echo(f"tokentrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Token-level latency profiling for LLM serving."""


def stdout_failed(err: OSError) -> NoReturn:
    """A usage error for output that standard output did not take (``> /dev/full``, a closed pipe).

    What is still buffered for it is sent to ``/dev/null`` instead, so the interpreter's last flush at exit
    does not fail again after the one line has been said.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no descriptor to replace (a test's captured stream)
        pass
    usage_error(f"cannot write to standard output: {err.strerror or err}")


@contextlib.contextmanager
def writing_stdout() -> Iterator[None]:
    """Turn a failed write to standard output (and its flush) into :func:`stdout_failed`."""
    try:
        yield
        sys.stdout.flush()
    except OSError as err:
        stdout_failed(err)


def shown_path(path: Path | str) -> str:
    """``path`` as printable text: bytes that are not UTF-8 shown as U+FFFD."""
    return os.fsencode(path).decode("utf-8", errors="replace")


def check_path(path: Path | None, what: str = "path") -> None:
    """A usage error unless ``path`` is valid UTF-8 (Arrow and DuckDB take only UTF-8 file names)."""
    if path is None:
        return
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        usage_error(f"the {what} {shown_path(path)} is not valid UTF-8; rename it or give another one")


def check_reachable(url: str, what: str, *, timeout_s: float = 5.0) -> None:
    """A usage error, at once and in one line, unless something accepts a TCP connection at ``url``'s host and
    port (an unknown host, a refused port, a URL without a host). A client's retries would otherwise take tens
    of seconds, a line per attempt, to say the same."""
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as err:
        usage_error(f"{what} {url!r} is not a URL: {err}")
    if not host:
        usage_error(f"{what} {url!r} names no host; e.g. http://127.0.0.1:8000")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except socket.gaierror as err:
        usage_error(f"cannot reach {what} {url}: unknown host {host} ({err.strerror or err})")
    except OSError as err:
        usage_error(f"cannot reach {what} {url}: {err.strerror or err or 'timed out'}")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """One sentence on stderr instead of a traceback, exit 2: a ``StoreError`` or an ``OSError`` (a path
    that cannot be read is bad input).

    Warnings (e.g. a skipped corrupt file) are shown as one ``warning:`` line each, each
    distinct message once however often the store is read.
    """
    shown: set[str] = set()

    def show(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
        text = str(message)
        if text not in shown:
            shown.add(text)
            typer.echo(f"warning: {text}", err=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            yield
        except StoreError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        except OSError as err:  # e.g. permission denied: a path this user cannot read
            typer.echo(f"error: cannot read {err.filename or 'the store'}: {err.strerror or err}", err=True)
            raise typer.Exit(EXIT_USAGE) from None


def format_ns(ns: int | None) -> str:
    """A duration in ns as a short human string: ``850 ns``, ``12.5 ms``, ``3.20 s``, ``2 h 05 m``."""
    if ns is None:
        return "-"
    if ns < 1_000:
        return f"{ns} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f} ms"
    seconds = ns / 1e9
    if seconds < 3600:
        return f"{seconds:.2f} s"
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60:02d} m"


def format_bytes(num: int) -> str:
    """A byte count as ``512 B``, ``12.3 KiB``, ``4.0 MiB``, ..."""
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{num} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _short_time(iso: str | None) -> str:
    """``2026-11-29T09:52:07.266643Z`` -> ``2026-11-29 09:52:07``."""
    return "-" if not iso else iso.replace("T", " ").split(".")[0].rstrip("Z")


def _span_text(span: tuple[int, int] | None) -> str:
    return "-" if span is None else format_ns(span[1] - span[0])


def _console() -> Console:
    """Stdout console; when piped (not a terminal) wide enough that tables are not cut."""
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else _PIPE_WIDTH)


@app.command("runs")
def runs_command(store: StoreArg = None, store_option: StoreOption = None) -> None:
    """List the runs of a store: rows per table, time span, dropped events."""
    store = store_of(store, store_option)
    check_path(store, "store")
    with user_errors():
        infos = list_runs(store)
    with writing_stdout():
        _console().print(_runs_table(store, infos))


def _runs_table(store: Path, infos: list[RunInfo]) -> RichTable:
    out = RichTable(title=f"runs in {store}")
    out.add_column("run id", overflow="fold")
    out.add_column("created (UTC)", overflow="fold")
    out.add_column("rows per table")
    for header in ("time span", "dropped", "sampled out"):
        out.add_column(header, justify="right")
    for info in infos:
        rows = "\n".join(f"{name} {num:,}" for name, num in info.tables.items()) or "(no data)"
        out.add_row(
            info.run_id,
            _short_time(info.created),
            rows,
            _span_text(info.time_span_ns),
            f"{info.num_dropped:,}",
            f"{info.num_sampled_out:,}",
        )
    return out


@app.command("inspect")
def inspect_command(
    store: StoreArg = None,
    run: Annotated[Optional[str], typer.Option("--run", help="Run id (default: the newest run).")] = None,
    store_option: StoreOption = None,
) -> None:
    """Describe one run: tables (rows, files, bytes), time span, counters, instances."""
    store = store_of(store, store_option)
    check_path(store, "store")
    with user_errors():
        opened = open_run(store, run)
        tables = [opened.table_info(name) for name in opened.tables()]
        span = opened.time_span_ns()
        manifest = opened.manifest  # read once: its warnings (bad counters) are said once
    console = _console()
    with writing_stdout():
        console.print(_run_header(opened, manifest, span))
        console.print(_tables_table(tables))
        console.print(_counters_table(dict(manifest["counters"])))
        console.print(_instances_table(list(manifest["instances"])))
        notes = _writer_notes(manifest)
        if notes:
            console.print("\n".join(notes))


def _writer_notes(manifest: dict[str, Any]) -> list[str]:
    """What the writers' fragments say went wrong: errors, and rows recovered from crash journals."""
    notes = []
    for frag in manifest.get("writers", []):
        writer = frag.get("writer", "?")
        errors = frag.get("errors") if isinstance(frag.get("errors"), dict) else {}
        for action, error in sorted(errors.items()):
            notes.append(f"writer {writer}: {action} failed: {error}")
        recovered = frag.get("recovered_rows") if isinstance(frag.get("recovered_rows"), dict) else {}
        if recovered:
            rows = ", ".join(f"{name} {num:,}" for name, num in sorted(recovered.items()))
            notes.append(f"writer {writer} ended without closing (killed); recovered from its crash journal: {rows}")
    return notes


def _run_header(opened: Run, manifest: dict[str, Any], span: tuple[int, int] | None) -> str:
    lines = [
        f"run [bold]{opened.run_id}[/bold]  ({opened.path})",
        f"created {manifest.get('created', '-')}, tokentrace {manifest.get('tokentrace_version', '-')}, "
        f"schema version {manifest.get('schema_version', '-')}, {len(manifest.get('writers', []))} writer(s)",
        "time span: -"
        if span is None
        else f"time span: {_span_text(span)} (ns {span[0]} .. {span[1]}, recording clocks)",
    ]
    return "\n".join(lines)


def _tables_table(tables: list[TableInfo]) -> RichTable:
    out = RichTable(title="tables")
    out.add_column("table")
    for header in ("rows", "files", "bytes"):
        out.add_column(header, justify="right")
    for info in tables:
        out.add_row(info.name, f"{info.num_rows:,}", f"{info.num_files:,}", format_bytes(info.num_bytes))
    return out


def _counters_table(counters: dict[str, int]) -> RichTable:
    out = RichTable(title="counters (summed over processes)")
    out.add_column("counter")
    out.add_column("value", justify="right")
    first = [k for k in (DROPPED, SAMPLED_OUT) if k in counters]
    for key in first + sorted(k for k in counters if k not in first):
        out.add_row(key, f"{counters[key]:,}")
    return out


def _instances_table(instances: list[dict[str, Any]]) -> RichTable:
    out = RichTable(title="instances")
    for header in ("instance", "role", "name", "host", "pid"):
        out.add_column(header)
    for inst in instances:
        values = (inst.get(key) for key in ("instance", "role", "name", "host", "pid"))
        out.add_row(*("-" if v is None else str(v) for v in values))
    return out


def register_commands(target: typer.Typer = app) -> None:
    """Add the subcommands of every module in :mod:`tokentrace.app.cli.commands` (idempotent)."""
    import importlib
    import pkgutil

    import tokentrace.app.cli.commands as commands

    if getattr(target, "_tokentrace_registered", False):
        return
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(target)
    target._tokentrace_registered = True  # type: ignore[attr-defined]


def main() -> None:
    """Console-script entry point (``tokentrace``)."""
    register_commands()
    app()


