"""The supervisor behind ``tokentrace run``: start the command traced, forward signals, save the facts.

:func:`run_traced` runs the command with the environment of
:func:`instrument.child_env.child_environment` (``TOKENTRACE_STORE``, ``TOKENTRACE_RUN``,
``TOKENTRACE_SAMPLE``, and a ``PYTHONPATH`` starting with tokentrace's ``sitecustomize``
folder), like ``opentelemetry-instrument``. Every Python process of the command, and every
process those spawn with the inherited environment (the reference server's worker
processes), writes into the same run.

Signals: SIGINT, SIGTERM and SIGHUP are forwarded to the command. The deployment never
outlives its supervisor: on Linux the command's first process is started with
``PR_SET_PDEATHSIG`` = SIGTERM, so when ``tokentrace run`` dies, even by SIGKILL, that
process gets SIGTERM, exactly as if it had been forwarded, and shuts down gracefully (the
reference server's gateway then stops its workers, whose control connections close). A
command that is a shell wrapper should ``exec`` the server so that the server is that first
process. Elsewhere than Linux the command runs on after a SIGKILL of the supervisor.

The exit status is the command's (128 + signal number if a signal ended it, 127 if it could
not be started). When the command has ended, one ``tokentrace:`` line per traced process
says what was hooked (the reference server's gateway or workers, an app that called
``tokentrace.instrument``), or that nothing was and how to trace the rest; then, when every
traced process closed its store writer, the run's shared analysis facts are derived once and
saved next to the run (``<run>/_derived``, :mod:`analyzers.derivation`); ``derive=False``
skips that, and a run some process did not close (killed) is left to derive on demand.

Tracing never stops the command: a store that cannot be written (a read-only mount, a path
under a file, a full disk) is one ``tokentrace:`` warning line on stderr, and the command
runs untraced. The run folder and its manifest are created here, before the command starts,
so that check is made once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import typer

__all__ = ["run_traced", "hooked_lines", "FORWARDED_SIGNALS"]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SAY_SAVING_BYTES = 64 << 20  # part files from which deriving takes long enough to say so first
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_MAX_LINES = 12  # lines saying what was hooked
_HOW_TO_TRACE = ("to trace your own server: add tokentrace's ASGI middleware to its app "
                 "(app.add_middleware(instrument.asgi.TokenTraceMiddleware)), or send OTLP spans to "
                 "`tokentrace ingest-otlp` (docs/instrumenting.md)")
_WHAT = {
    "gateway": "the reference server's gateway",
    "prefill": "a reference-server prefill worker",
    "decode": "a reference-server decode worker",
    "colocated": "a reference-server worker",
}
_CLIENT_ROLE = "client"


def run_traced(command: list[str], *, store: Path, run: str | None = None, sample: float | None = None,
               metrics_port: int | None = None, derive: bool = True) -> int:
    """Run ``command`` traced into ``store``/``run`` (a new run id if None); its exit status.

    Blocks until the command ends; forwards SIGINT/SIGTERM/SIGHUP to it meanwhile (main
    thread only). ``metrics_port``: each traced process serves live Prometheus metrics on the
    first free port from it (:mod:`tokentrace.live_metrics`). ``derive``: save the finished
    run's analysis facts once the command ended (see the module doc). ``ValueError`` for an
    empty command, a bad run id, a sample rate outside (0, 1] or a bad port.
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
        child = subprocess.Popen(command, env=env, preexec_fn=_die_with_parent())
    except OSError as err:
        typer.echo(f"error: cannot start {command[0]!r}: {err}", err=True)
        return 127
    code = _wait_forwarding(child)
    if problem is None:
        for line in hooked_lines(store / run_id):
            typer.echo(f"tokentrace: {line}", err=True)
        if derive:
            _save_facts(store, run_id)
    return 128 - code if code < 0 else code


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child SIGTERM when this process dies (Linux), else None.

    The ``prctl`` function is looked up here, before the fork: the child only calls it.
    A parent that died between the fork and the ``prctl`` call is caught by comparing the
    child's parent pid with ours.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal


def _wait_forwarding(child: subprocess.Popen[bytes]) -> int:
    """Wait for ``child``, forwarding :data:`FORWARDED_SIGNALS` to it; its return code."""
    previous: dict[int, Any] = {}

    def forward(signum: int, frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for sig in FORWARDED_SIGNALS:
        previous[sig] = signal.signal(sig, forward)
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # a handler replaced ours; keep waiting for the child
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def hooked_lines(run_dir: Path) -> list[str]:
    """What the traced processes of a finished run hooked, one line each (from the run's manifest
    fragments), or the lines saying that nothing was hooked and how to trace the rest."""
    from instrument.asgi import ASGI_APP_NAME
    from tokentrace.store.manifest import read_fragments

    lines = []
    roles = set()
    for fragment in sorted(read_fragments(run_dir), key=lambda f: int(f.get("pid") or 0)):
        config = fragment.get("config") or {}
        instances = fragment.get("instances") or []
        role = str(instances[-1].get("role") if instances else config.get("role", ""))
        name = str(instances[-1].get("name") if instances else config.get("name", ""))
        roles.add(role)
        if role == _CLIENT_ROLE:
            what = "a load client (the client's view of each request)"
        elif config.get("launcher") == "tokentrace run" and name.startswith(ASGI_APP_NAME):
            what = "an ASGI app, through tokentrace's middleware"
        elif config.get("launcher") == "tokentrace run":
            what = _WHAT.get(role, "a reference-server engine")
        elif config.get("source"):
            what = f"the {config['source']} importer"
        else:
            what = f"an app that calls tokentrace.instrument() (role {role or 'unknown'})"
        rows = fragment.get("rows_written") or {}
        lines.append(f"hooked pid {fragment.get('pid')}: {what}{f' {name!r}' if name else ''}; "
                     f"{int(rows.get('requests', 0))} request row(s), {int(rows.get('spans', 0))} stage span(s)")
    if len(lines) > _MAX_LINES:  # hundreds of worker processes: the first ones, then a count
        lines = lines[:_MAX_LINES - 1] + [f"... and {len(lines) - _MAX_LINES + 1} more hooked process(es)"]
    if not roles - {_CLIENT_ROLE}:
        lines.append("no server process of the command was hooked, so the run has no server lane: `tokentrace run` "
                     "hooks the reference server (python -m reference_server) by itself; " + _HOW_TO_TRACE)
    return lines


def _save_facts(store: Path, run_id: str) -> None:
    """Derive the finished run's shared analysis facts; one line on stderr, never an error.

    The facts are a cache: when they cannot be written (read-only store, full disk) or
    this is interrupted, analyses compute them from the part files as before.
    """
    import time

    from analyzers.derivation import derive
    from tokentrace.store import open_run
    from tokentrace.store.derived import DERIVED_DIR

    try:
        run = open_run(store, run_id)
        if not run.is_finished():
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
