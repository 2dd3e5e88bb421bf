"""``tokentrace why``: for each request that missed a target, the causes of its time over target and the fix.

Text tells one request's story in sentences (``--request KEY``), or, without it, the run's SLO
verdict, its causes ranked by the share of missed time they explain, and the stories of the
requests furthest over target. ``--format json`` prints a list with one object per missed request
(``request_key``, ``missed``, ``excess_ms``, ``causes``), first cause the largest.

Exit codes: 0 on success (whether or not targets were missed), 2 on bad input (missing or empty
store, unknown run or request key, a target that is not a positive number): one sentence on
stderr, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["register", "why_command", "NUM_STORIES"]

NUM_STORIES = 5  # requests told in full without --request


def why_command(
    store: Annotated[Path, typer.Argument(help="Store folder (or one run's folder).", show_default=False)],
    run: Annotated[Optional[str], typer.Option("--run", help="Run id (default: the newest run).")] = None,
    request: Annotated[Optional[str], typer.Option(
        "--request", help="One request's key (the client's X-Request-Id when it sent one).")] = None,
    ttft_ms: Annotated[Optional[float], typer.Option("--ttft-ms", help="TTFT target for every class, ms.")] = None,
    itl_ms: Annotated[Optional[float], typer.Option(
        "--itl-ms", help="ITL target for every token gap, ms (default: the class's TPOT target).")] = None,
    e2e_ms: Annotated[Optional[float], typer.Option("--e2e-ms", help="End-to-end target, ms (default: none).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
) -> None:
    """Why requests missed their targets: each one's causes in ms, with evidence and the setting to change."""
    from analyzers.analysis import RunAnalysis
    from tokentrace.app.cli.commands.report import exit_on_bad_input
    from tokentrace.app.report.inputs import ReportInputError, open_checked
    from tokentrace.schema import REQUESTS, col

    with exit_on_bad_input():
        kind = fmt.strip().lower()
        if kind not in ("text", "json"):
            raise ReportInputError(f"unknown format {fmt!r}; formats: text, json")
        opened, _ = open_checked(store, run, required=(REQUESTS.name,))
        analysis = RunAnalysis(opened)
        diagnosis = analysis.diagnosis(ttft_ms=ttft_ms, itl_ms=itl_ms, e2e_ms=e2e_ms)
        requests = diagnosis.requests
        if request is not None:
            known = analysis.source.scalar(
                f"SELECT COUNT(*) FROM srv_requests WHERE {col.REQUEST_KEY} = '{request.replace(chr(39), chr(39) * 2)}'")
            if not known:
                raise ReportInputError(f"run {opened.run_id} has no request with key {request!r}")
            requests = requests[requests[col.REQUEST_KEY] == request]
    if kind == "json":
        typer.echo(json.dumps(_json(requests, diagnosis.causes), indent=2))
    elif request is not None:
        typer.echo(_story(requests, diagnosis.causes) if len(requests)
                   else f"{request} met its targets (or was not served): nothing to explain.")
    else:
        typer.echo(_overview(diagnosis))


def _json(requests, causes) -> list[dict]:
    from tokentrace.app.report.diagnosis import request_json
    from tokentrace.schema import col

    return [request_json(r, causes[causes[col.REQUEST_ID] == r[col.REQUEST_ID]])
            for r in requests.to_dict("records")]


def _story(requests, causes) -> str:
    from tokentrace.app.report.diagnosis import request_story
    from tokentrace.schema import col

    return "\n\n".join(request_story(r, causes[causes[col.REQUEST_ID] == r[col.REQUEST_ID]])
                       for r in requests.to_dict("records"))


def _overview(diagnosis) -> str:
    from tokentrace.app.report.diagnosis import cause_lines, slo_verdict

    lines = [slo_verdict(diagnosis), *cause_lines(diagnosis)]
    if diagnosis.num_missed:
        worst = diagnosis.requests.head(NUM_STORIES)
        lines += ["", (f"The {len(worst)} requests furthest over target:" if len(worst) != 1 else
                          "The request furthest over target:"), "", _story(worst, diagnosis.causes)]
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    app.command("why")(why_command)
