"""``tokentrace whatif``: predict a changed configuration from a simulator fitted to the run's own trace.

``tokentrace whatif STORE [--run RUN] --set NAME=VALUE [--set ...] [--sweep NAME=START:STOP:STEP]
[--format text|json]``. The simulator is fitted to the run and replays the run itself first; its error
there (``fit_error``) comes with every answer. Exit codes: 0 on success, 2 on bad input (a missing or
empty store, an unknown run, a run without engine steps, an unknown setting or a bad value): one sentence
on stderr, never a traceback.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

__all__ = ["register", "whatif_command"]


def whatif_command(
    store: Annotated[Path, typer.Argument(help="Store folder (or one run's folder).", show_default=False)],
    run: Annotated[Optional[str], typer.Option("--run", help="Run id (default: the newest run).")] = None,
    settings: Annotated[Optional[list[str]], typer.Option(
        "--set", help="A changed setting, NAME=VALUE (repeatable): rate_scale, output_scale, max_num_seqs, "
                      "max_num_batched_tokens, num_device_blocks, scheduling_policy, instances, "
                      "prefill_instances, decode_instances, step_time_scale.")] = None,
    sweep: Annotated[Optional[str], typer.Option(
        "--sweep", help="Predict over a range of one setting, NAME=START:STOP:STEP or NAME=V1,V2,...; prints the "
                        "curve and the highest value that meets the SLO targets.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
) -> None:
    """Predict latency, throughput and SLO attainment under changed settings, from a simulator fitted to the run.

    The fit is checked on the run itself first (its own error is printed)."""
    from analyzers.source import Source
    from analyzers.whatif import check_settings, fit_whatif, parse_setting, parse_sweep
    from tokentrace.app.cli.commands.report import exit_on_bad_input
    from tokentrace.app.report.inputs import ReportInputError, open_checked
    from tokentrace.app.report.whatif import sweep_json, sweep_lines, whatif_json, whatif_lines
    from tokentrace.schema import STEPS

    with exit_on_bad_input():
        kind = fmt.strip().lower()
        if kind not in ("text", "json"):
            raise ReportInputError(f"unknown format {fmt!r}; formats: text, json")
        changed = check_settings(dict(parse_setting(s) for s in settings or []))
        swept = parse_sweep(sweep) if sweep else None
        if swept is not None and swept[0] in changed:
            raise ReportInputError(f"{swept[0]} is both swept and set")
        opened, _ = open_checked(store, run, required=(STEPS.name,))
        src = Source.of_run(opened)
        try:
            model = fit_whatif(src)
            if swept is not None:
                result = model.sweep(swept[0], swept[1], changed)
                doc: dict[str, Any] = sweep_json(model, result)
                lines = sweep_lines(model, result, opened.run_id)
            else:
                prediction = model.predict(changed)
                doc = whatif_json(model, prediction)
                lines = whatif_lines(model, prediction, opened.run_id)
        finally:
            src.close()
    if kind == "json":
        typer.echo(json.dumps(_finite(doc), indent=2, sort_keys=False))
    else:
        typer.echo("\n".join(lines))


def _finite(x: Any) -> Any:
    """NaN and infinities -> null (JSON has neither): a metric not measured is null, never 0."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def register(app: typer.Typer) -> None:
    app.command("whatif")(whatif_command)
