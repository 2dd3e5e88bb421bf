"""``tokentrace run``: trace a whole deployment, every Python process it starts, with no code change.

``tokentrace run --store DIR [--run ID] [--sample RATE] -- <command...>`` runs
the command with the environment of :func:`instrument.child_env.child_environment`
(``TOKENTRACE_STORE``, ``TOKENTRACE_RUN``, ``TOKENTRACE_SAMPLE``, and a
``PYTHONPATH`` starting with tokentrace's ``sitecustomize`` folder), like
``opentelemetry-instrument``. Every Python process of the command, and every
process those spawn with the inherited environment (the reference server's
worker processes), writes into the same run. SIGINT and SIGTERM are forwarded
to the command; the exit status is the command's (128 + signal number if a
signal ended it, 127 if it could not be started).

When the command has ended and every traced process closed its store writer,
the run's shared analysis facts (per-token and per-request tables that every
analysis starts from) are derived once and saved next to the run
(``<run>/_derived``, :mod:`analyzers.derivation`): the run's first report or
dashboard view then reads them instead of computing them. ``--no-derive`` skips
that; a run some process did not close (killed) is left to derive on demand.

Tracing never stops the command: a store that cannot be written (a read-only
mount, a path under a file, a full disk) is one ``tokentrace:`` warning line on
stderr, and the command runs untraced. The run folder and its manifest are
created here, before the command starts, so that check is made once.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

__all__ = ["register", "run_traced"]

_FORWARDED = (signal.SIGINT, signal.SIGTERM)
_SAY_SAVING_BYTES = 64 << 20  # part files from which deriving takes long enough to say so first


def run_traced(command: list[str], *, store: Path, run: str | None = None, sample: float | None = None,
               metrics_port: int | None = None, derive: bool = True) -> int:
    """Run ``command`` traced into ``store``/``run`` (a new run id if None); its exit status.

    Blocks until the command ends; forwards SIGINT/SIGTERM to it meanwhile
    (main thread only). ``metrics_port``: each traced process serves live Prometheus
    metrics on the first free port from it (:mod:`tokentrace.live_metrics`). ``derive``: save
    the finished run's analysis facts once the command ended (see the module doc). ``ValueError``
    for an empty command, a bad run id, a sample rate outside (0, 1] or a bad port.
    """
    from instrument.child_env import ENV_RUN, ENV_SAMPLE, ENV_STORE, child_environment
    from tokentrace.store import new_run_id, validate_run_id

    if not command:
        raise ValueError("give the command to run after --, e.g. tokentrace run --store st -- python -m reference_server")
    if sample is not None and not 0.0 < sample <= 1.0:
        raise ValueError(f"--sample must be in (0, 1], got {sample}")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be in 0..65535, got {metrics_port}")
    run_id = new_run_id() if run is None else validate_run_id(run)
    problem = _create_run(store, run_id, sample)
    if problem is None:
        env = child_environment(store, run_id, sample, metrics_port=metrics_port)
        typer.echo(f"tokentrace: tracing into {store.resolve() / run_id}", err=True)
    else:
        env = {k: v for k, v in os.environ.items() if k not in (ENV_STORE, ENV_RUN, ENV_SAMPLE)}
        typer.echo(f"tokentrace: warning: cannot write the store at {store} ({problem}); "
                   f"running the command untraced", err=True)
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as err:
        typer.echo(f"error: cannot start {command[0]!r}: {err}", err=True)
        return 127
    previous: dict[int, Any] = {}

    def forward(signum: int, frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for sig in _FORWARDED:
        previous[sig] = signal.signal(sig, forward)
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # a handler replaced ours; keep waiting for the child
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if derive and problem is None:
        _save_facts(store, run_id)
    return 128 - code if code < 0 else code


def _save_facts(store: Path, run_id: str) -> None:
    """Derive the finished run's shared analysis facts; one line on stderr, never an error.

    The facts are a cache: when they cannot be written (read-only store, full disk) or
    this is interrupted, analyses compute them from the part files as before.
    """
    import time

    from analyzers.derivation import derive, run_is_finished
    from tokentrace.store import open_run
    from tokentrace.store.derived import DERIVED_DIR

    try:
        run = open_run(store, run_id)
        if not run_is_finished(run):
            return  # a process did not close its writer (killed): its journal is recovered on first read
        started = time.monotonic()
        if sum(p.stat().st_size for p in run.path.rglob("part-*.parquet")) >= _SAY_SAVING_BYTES:
            typer.echo("tokentrace: saving the run's analysis facts for quick reports and views...", err=True)
        written = derive(run)
        typer.echo(f"tokentrace: saved {len(written)} fact table(s) in {time.monotonic() - started:.1f} s "
                   f"({store.resolve() / run_id / DERIVED_DIR})", err=True)
    except KeyboardInterrupt:
        typer.echo("tokentrace: interrupted while saving the analysis facts; analyses compute them as needed", err=True)
    except OSError:
        pass  # a store that cannot be written (full, read-only) was said when tracing; analyses compute them as needed
    except Exception as err:  # noqa: BLE001 - a cache: the part files remain the answer
        typer.echo(f"tokentrace: warning: could not save the analysis facts ({err}); "
                   f"analyses compute them as needed", err=True)


def _create_run(store: Path, run_id: str, sample: float | None) -> str | None:
    """Create the run's folder and manifest; why that failed (one phrase), or None."""
    from tokentrace.store.manifest import write_run_manifest

    try:
        run_dir = store / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_manifest(run_dir, run_id, {"launcher": "tokentrace run", "sample": 1.0 if sample is None else sample})
    except OSError as err:
        return err.strerror or str(err)
    return None


def run_command(
    command: Annotated[list[str], typer.Argument(help="The command to trace, after --.")],
    store: Annotated[Path, typer.Option(help="Store folder every traced process writes into.")],
    run: Annotated[Optional[str], typer.Option(help="Run id (default: a new time-stamped id).")] = None,
    sample: Annotated[Optional[float], typer.Option(help="Head-sampling rate in (0, 1]; default: every request.")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(
        help="Serve live Prometheus metrics (/metrics on 127.0.0.1) from each traced process, on the first "
             "free port from this one.")] = None,
    derive: Annotated[bool, typer.Option(
        "--derive/--no-derive",
        help="When the command has ended, save the run's analysis facts next to it so that its first report "
             "and dashboard views are quick.")] = True,
) -> None:
    """Run a command with every Python process it starts traced (like opentelemetry-instrument)."""
    try:
        code = run_traced(list(command), store=store, run=run, sample=sample, metrics_port=metrics_port,
                          derive=derive)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("run", context_settings={"allow_interspersed_args": False})(run_command)
