"""The demo's report in the terminal: the key sections of ``tokentrace report``, drawn with rich.

Nothing is recomputed here: :func:`tokentrace.app.report.make_report` gathers the
analyses (the same :class:`~tokentrace.app.report.model.Report` that ``tokentrace
report`` renders as Markdown), and this module only formats its sections. The
report's first lines come first here too: whether the run was saturated and
which pool (offered against served load), the instance advice, and the
attribution invariant's signed unattributed and overlap figures.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tokentrace.app.report.frames import format_cell
from tokentrace.app.report.render_names import column_label, for_people, instance_labels, is_percent_column
from tokentrace.schema import REQUESTS, SPANS, TOKENS

__all__ = ["TERMINAL_SECTIONS", "print_report", "section_table", "verdict_lines", "headline_lines",
           "saturation_lines", "run_line"]

TERMINAL_SECTIONS: dict[str, int] = {"latency": 1, "stage_breakdown": 1, "slo": 1, "speculative": 2, "sessions": 0,
                                     "tenants": 2, "agreement": 1}
"""Report sections shown in the terminal, in order, and how many of each one's tables (the
rest of the report: ``tokentrace report``, the HTML report and the dashboard)."""
ONLY_WITH_TABLES = frozenset({"speculative", "sessions"})
"""Sections left out of the terminal when they hold no table (a run without speculation or sessions)."""
UNATTRIBUTED_TARGET = 0.01  # the attribution invariant's bound: under 1% of token latency
_MAX_ROWS = 20
_COLUMN_GAP = 3  # characters between two columns: padding, the (blank) rule, padding


def _cell(column: str, value: Any) -> str:
    """One value as the reports write it (:func:`tokentrace.app.report.frames.format_cell`): thousands separators,
    shares as percentages; a whole number of tokens or requests without decimals."""
    if isinstance(value, float) and value.is_integer() and abs(value) >= 100 and not is_percent_column(column):
        return f"{int(value):,}"
    return format_cell(value, column)


_HIDDEN = ("num_ttft_measured", "num_tpot_measured")  # in `tokentrace report`; too wide for a terminal's table


def _header(column: str) -> str:
    """A column name as a header a person reads, with its unit: ``ttft_target_ms`` -> ``TTFT target (ms)``."""
    return column_label(column)


def _widths(headers: list[str], cells: list[list[str]], available: int | None) -> list[int | None]:
    """Column widths that split no word and no number: each column gets its widest cell and its header's
    longest word, and what is left of ``available`` goes, one character at a time, to the columns whose
    header still wraps; all None (rich's own layout) when every header fits on one line."""
    natural = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    least = [max([len(w) for w in h.split()] + [len(row[i]) for row in cells] + [1]) for i, h in enumerate(headers)]
    gaps = _COLUMN_GAP * (len(headers) - 1)
    if available is None or sum(natural) + gaps <= available:
        return [None] * len(headers)
    widths = list(least)
    budget = available - gaps - sum(widths)
    while budget > 0 and any(w < n for w, n in zip(widths, natural)):
        for i, want in enumerate(natural):
            if budget > 0 and widths[i] < want:
                widths[i] += 1
                budget -= 1
    return list(widths)


def section_table(frame: pd.DataFrame, *, title: str = "", names: dict[int, str] | None = None,
                  width: int | None = None) -> Table:
    """A rich table of a report frame: shares as percentages, times as given (ms columns say so), instances by
    name (``names``: instance id -> name; an id is never printed). ``width``: the terminal's columns; headers
    then wrap between words, and no word or number is split (:func:`_widths`)."""
    frame = for_people(frame, names or {}).drop(columns=[c for c in _HIDDEN if c in frame.columns])
    # A rule under the header only, and no edges: an eight-column table fits 80 columns.
    table = Table(title=title or None, title_justify="left", show_lines=False, box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, padding=(0, 1))
    shown = frame.head(_MAX_ROWS)
    cells = [[_cell(str(c), v) for c, v in zip(frame.columns, row)]  # (iterrows would make every int a float)
             for row in shown.itertuples(index=False, name=None)]
    headers = [_header(str(name)) for name in frame.columns]
    for name, header, fixed in zip(frame.columns, headers, _widths(headers, cells, width)):
        text = not pd.api.types.is_numeric_dtype(frame[name])
        table.add_column(header, justify="left" if text else "right", width=fixed, overflow="fold")
    for row in cells:
        table.add_row(*row)
    if len(frame) > _MAX_ROWS:
        table.caption = f"first {_MAX_ROWS} of {len(frame)} rows"
    return table


def headline_lines(report: Any) -> list[str]:
    """The report's first lines with rich markup: the SLO verdict (red when a target was missed) and its first
    cause, then the load verdict (red when saturated, green only when targets were met too)."""
    diagnosis = getattr(report, "diagnosis", {}) or {}
    missed = bool(diagnosis.get("num_missed"))
    lines = []
    for line in getattr(report, "headline", ()):
        text = escape(line)
        if line == diagnosis.get("verdict"):
            lines.append(f"[bold red]{text}[/]" if missed else f"[bold green]{text}[/]")
        elif line.startswith("Why #1"):
            lines.append(text)
        elif line == report.load.get("verdict"):
            saturated = report.load.get("saturated")
            lines.append(f"[bold red]{text}[/]" if saturated is True else
                         f"[bold green]{text}[/]" if saturated is False and not missed else f"[bold]{text}[/]")
            break
    return lines


def verdict_lines(report: Any) -> list[str]:
    """The demo's checks in words: unattributed (signed) and overlap shares, client/server agreement (rich markup)."""
    lines = []
    share = report.metrics.get("unattributed.share")
    overlap = report.metrics.get("overlap.share")
    if share is not None and math.isfinite(share):
        ok = abs(share) < UNATTRIBUTED_TARGET
        mark = "[green]OK[/]" if ok else "[yellow]above target[/]"
        lines.append(f"unattributed time: {100 * share:+.3f}% of token latency (signed; target |x| < "
                     f"{100 * UNATTRIBUTED_TARGET:.0f}%): {mark}")
    if overlap is not None and math.isfinite(overlap):
        mark = "[green]OK[/]" if overlap < UNATTRIBUTED_TARGET else "[yellow]above target[/]"
        lines.append(f"overlap (time two stages both claim): {100 * overlap:.3f}% of token latency (target < "
                     f"{100 * UNATTRIBUTED_TARGET:.0f}%): {mark}")
    try:
        agreement = report.section("agreement")
    except KeyError:
        return lines
    if agreement.tables:
        df = agreement.tables[0][1].set_index("metric")
        for metric in ("ttft", "itl"):
            if metric in df.index and df.loc[metric, "count"]:
                r = df.loc[metric]
                lines.append(f"{metric.upper()} server - client: median {r['p50_ms']:+.2f} ms, "
                             f"mean {r['mean_ms']:+.2f} ms over {int(r['count'])} tokens")
    return lines


def run_line(report: Any) -> str:
    """The run in one line: requests (not rows), tokens and spans, the processes by name (rich markup)."""
    run = report.run
    names = sorted(instance_labels(list(run.instances)).values())
    num = report.load.get("num_requests") if getattr(report, "load", None) else None
    requests = f"{int(num):,} requests" if isinstance(num, (int, float)) and num == num else "its requests"
    rows = run.rows
    return (f"[bold]run[/] {escape(run.run_id)} at {escape(run.path)}: {requests} traced by {len(names)} processes "
            f"({escape(', '.join(names))}); {rows.get(TOKENS.name, 0):,} token rows and {rows.get(SPANS.name, 0):,} "
            f"spans ({rows.get(REQUESTS.name, 0):,} request rows: each process writes its own row of a request)")


def saturation_lines(report: Any, time_scale: float = 1.0) -> list[str]:
    """When the server was saturated, what that means for the figures and what to change (rich markup); [] when
    it was not (or not judged)."""
    if report.load.get("saturated") is not True:
        return []
    pool = report.load.get("pool")
    slower = max(2.0, round(2 * time_scale, 1))
    return [f"[bold yellow]The server was saturated[/]{f' (the {escape(str(pool))} pool)' if pool else ''}: "
            f"requests arrived faster than this machine served them, so queueing grew through the run and the "
            f"figures above describe an overloaded server. Other processes on the machine (its load average is "
            f"printed after the load) take CPU from it. For a run with headroom: [bold]--time-scale {slower:g}[/] "
            f"(arrivals {slower / time_scale:g}x further apart), fewer requests (--requests), or shorter outputs "
            f"(--output-scale)."]


def print_report(report: Any, console: Console) -> None:
    """Print the run header, :data:`TERMINAL_SECTIONS` and the verdicts (caller's thread)."""
    console.print(run_line(report))
    names = instance_labels(list(report.run.instances))
    for line in headline_lines(report):
        console.print(line)
    for key, num_tables in TERMINAL_SECTIONS.items():
        try:
            section = report.section(key)
        except KeyError:
            continue
        if key in ONLY_WITH_TABLES and not section.tables:
            continue
        console.rule(f"[bold]{section.title}")
        if section.note:
            console.print(section.note)
        for caption, frame in section.tables[:num_tables]:
            console.print(section_table(frame, title=caption, names=names, width=console.width))
    console.rule("[bold]Checks")
    for line in verdict_lines(report):
        console.print(line)
