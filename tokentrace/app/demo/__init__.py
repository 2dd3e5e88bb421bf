"""``tokentrace demo``: the whole path, end to end, on one machine.

1. checks that the dashboard's port is free (before minutes of load, not after)
   and the Mooncake conversation trace is there, and plans a slice of it (scaled
   to a CPU; the scaling is printed), with three tenants and two SLO classes;
2. starts the reference server disaggregated (1 prefill and 1 decode worker)
   under ``tokentrace run`` (:mod:`tokentrace.app.demo.server`) and waits for READY;
3. replays the slice through the load generator, in this process, recording the
   client's own view into the same store run (:mod:`tokentrace.app.demo.load`);
4. stops the server with SIGINT so every traced process flushes its store;
5. prints the report's key sections: latency, where the time went (stage shares,
   mean and tail), SLOs, tenants, client-vs-server agreement and the
   unattributed share (:mod:`tokentrace.app.demo.report`), and where the store is;
   when the server was saturated it says so, with what to change;
6. serves the dashboard on 127.0.0.1 until Ctrl-C (unless ``dashboard=False``).

Ctrl-C at any step stops every process the demo started and leaves a readable
store. Like the CLI, this module is part of the facade: the report, the
dashboard and the bench machinery are imported inside functions.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from tokentrace.app.bench.workloads import default_traces_dir
from tokentrace.app.demo.load import (
    DEMO_TENANTS,
    LoadSpec,
    build_load_plan,
    fit_to_context,
    mean_output_tokens,
    run_load,
    write_tenants_file,
)
from tokentrace.app.demo.report import print_report, saturation_lines
from tokentrace.app.demo.server import ServerSpec, TracedServer

__all__ = ["DemoOptions", "DemoResult", "run_demo", "serve_dashboard", "check_port", "demo_model", "model_context",
           "TRACE_FILE", "BUNDLED_TRACE_ROWS", "bundled_trace", "SPECULATIVE_MODEL", "SPECULATIVE_SOURCE"]

TRACE_FILE = "mooncake_conversation.jsonl"  # the whole trace, in the traces folder (TOKENTRACE_TRACES)
BUNDLED_TRACE_FILE = "mooncake_conversation_first80.jsonl"  # its first lines, shipped in the package
BUNDLED_TRACE_ROWS = 80
TRACE_ORIGIN = ("The demo's trace is Mooncake's conversation trace (github.com/kvcache-ai/Mooncake, "
                "FAST25-release/traces/conversation_trace.jsonl, Apache-2.0)")
DEFAULT_MODEL = "trained"  # the bundled trained model: its answers read as text (the presets have random weights)
SPECULATIVE_MODEL = "trained"  # the bundled trained model, whose bundled draft model (trained-draft) drafts for it
SPECULATIVE_SOURCE = "model"  # what --speculative turns on: a draft model (the server's --speculative)
_DRAFT_WORDS = {"model": "the bundled draft model", "ngram": "n-gram prompt lookup", "early_exit": "early exit"}
_STEPS = 6


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """Every knob of the demo; the defaults fit a 2-core CPU with headroom (load phase about a minute)."""

    store: Path = Path("demo-store")
    num_requests: int = 80  # the first N requests of the trace: ~27 s of its arrivals (~3 req/s)
    model: str | None = None  # None: "trained" (the bundled trained model, 1.1 M parameters, 1,024 positions)
    speculative: str | None = None  # draft source on the decode worker (model, ngram, early_exit); None: off
    time_scale: float = 1.0  # x Mooncake arrival times (real time)
    length_scale: float = 1 / 64  # prompts: 512-token trace blocks become 8 tokens, ~200-token prompts
    output_scale: float = 1 / 16  # outputs: ~22 tokens per request on average (1-58), enough to time each token
    block_size: int = 8  # server KV block size; prompt blocks align to it, so it bounds the shortest block
    trace: Path | None = None  # default: the bundled first 80 requests (more: the traces folder's whole file)
    run: str | None = None  # default: a new time-stamped run id
    dashboard: bool = True
    port: int = 8050  # dashboard port on 127.0.0.1
    ready_timeout_s: float = 180.0  # server start-up (worker processes load the model)
    load_duration_s: float = 150.0  # no request is sent later than this
    load_drain_s: float = 30.0  # then in-flight requests get this long
    stop_grace_s: float = 30.0  # SIGINT -> SIGKILL
    device: str | None = None  # cpu | cuda; None: the server's choice
    seed: int = 0
    sessions: str | None = None  # a session mix (agent, chat) instead of the trace's requests; None: the trace
    num_sessions: int = 12
    session_rate: float = 0.5  # sessions starting per second (Poisson)
    session_length_scale: float = 0.25  # agent: a 256-token task, 8-24-token tool results, 4-8-token tool calls
    kv_retention: str = "lru"  # the server's policy for a finished turn's KV: lru, keep, offload, drop


@dataclass(frozen=True, slots=True, eq=False)
class DemoResult:
    """What the demo produced: the run, its report, and what the client saw."""

    run_id: str
    run_path: Path
    report: Any  # tokentrace.app.report.Report
    num_sent: int
    num_ok: int
    server_exit: int | None  # exit status of `tokentrace run` after SIGINT (0: clean)


def _step(console: Console, n: int, text: str) -> None:
    console.print(f"\n[bold cyan][{n}/{_STEPS}][/] {text}")


def bundled_trace() -> Path:
    """The trace shipped in the package: the first :data:`BUNDLED_TRACE_ROWS` requests of the Mooncake
    conversation trace, unchanged (origin and licence in ``tokentrace/app/demo/traces/README.md``)."""
    return Path(__file__).resolve().parent / "traces" / BUNDLED_TRACE_FILE


def _trace_path(opts: DemoOptions) -> Path:
    """The trace to replay: ``--trace``, else the bundled slice when it holds ``--requests`` requests, else the
    whole trace in the traces folder; ``ValueError`` naming the trace's origin and the trace-free workloads."""
    if opts.trace is not None:
        path = Path(opts.trace)
        missing = f"trace file not found: {path}"
    elif opts.num_requests <= BUNDLED_TRACE_ROWS:
        path = bundled_trace()
        missing = f"the bundled trace is missing from this installation ({path})"
    else:
        path = default_traces_dir() / TRACE_FILE
        missing = (f"--requests {opts.num_requests} needs more than the {BUNDLED_TRACE_ROWS} bundled requests, "
                   f"and the whole trace is not at {path}")
    if not path.is_file():
        raise ValueError(f"{missing}. {TRACE_ORIGIN}; pass the whole file with --trace FILE (or point "
                         f"TOKENTRACE_TRACES at its folder), use --requests {BUNDLED_TRACE_ROWS} or fewer for the "
                         f"bundled slice, or run a workload that needs no trace: --sessions chat or --sessions agent")
    return path


def _load_spec(opts: DemoOptions, trace: Path) -> LoadSpec:
    if opts.num_requests < 1:
        raise ValueError(f"--requests must be >= 1, got {opts.num_requests}")
    return LoadSpec(trace=trace, num_requests=opts.num_requests, time_scale=opts.time_scale,
                    length_scale=opts.length_scale, output_scale=opts.output_scale, block_size=opts.block_size,
                    seed=opts.seed, duration_s=opts.load_duration_s, drain_s=opts.load_drain_s)


def demo_model(opts: DemoOptions) -> str:
    """The model the demo serves and asks for: ``opts.model``, else the bundled trained model (whose answers read
    as text, and for which the bundled draft model was trained)."""
    return opts.model or (SPECULATIVE_MODEL if opts.speculative else DEFAULT_MODEL)


def model_context(model: str) -> int:
    """The context window, in tokens, of a reference-server model: a preset's or a bundled model's;
    ``ValueError`` naming the presets for an unknown name."""
    from reference_server.model.bundled import bundled_checkpoint
    from reference_server.model.config import ModelConfig

    folder = bundled_checkpoint(model)
    return (ModelConfig.from_hf_config(folder) if folder is not None else ModelConfig.preset(model)).max_position


def _run_id(opts: DemoOptions) -> str:
    from tokentrace.store import new_run_id, validate_run_id

    return new_run_id() if opts.run is None else validate_run_id(opts.run)


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """``ValueError`` naming the port when something already listens on it (a dashboard left running, say)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise ValueError(f"the dashboard's port {port} on {host} is in use ({err.strerror or err}): stop what "
                             f"listens there, or pass --port with a free port, or --no-dashboard") from None


def _plan(opts: DemoOptions, run_id: str, console: Console) -> tuple[Any, Any]:
    _step(console, 1, "checks and the plan")
    if opts.dashboard:
        check_port(opts.port)
        console.print(f"  dashboard port {opts.port} on 127.0.0.1 is free (checked now, before the load)")
    from reference_server.engine.retention import RETENTION_POLICIES

    if opts.kv_retention not in RETENTION_POLICIES:
        raise ValueError(f"unknown --kv-retention {opts.kv_retention!r}; choose one of {', '.join(RETENTION_POLICIES)}")
    if opts.sessions:
        return _session_plan(opts, run_id, console)
    trace = _trace_path(opts)
    spec = _load_spec(opts, trace)
    console.print(f"  trace: {trace}")
    plan = fit_to_context(build_load_plan(spec, key_prefix=f"demo-{run_id}"), model_context(demo_model(opts)))
    for line in plan.description:
        console.print(f"  {line}")
    span_s = max((r.offset_s for r in plan.requests), default=0.0)
    console.print(f"  {len(plan.requests)} requests over {span_s:.0f} s, {mean_output_tokens(plan):.1f} output tokens "
                  f"each on average (--requests {opts.num_requests}, --time-scale {opts.time_scale:g}, "
                  f"--length-scale {opts.length_scale:g}, --output-scale {opts.output_scale:g})")
    console.print("  scheduling weights and default classes: " + ", ".join(
        f"{t.name} {t.weight:g} ({t.default_slo_class})" for t in DEMO_TENANTS))
    return spec, plan


def _session_plan(opts: DemoOptions, run_id: str, console: Console) -> tuple[Any, Any]:
    from tokentrace.app.demo.sessions import SessionLoadSpec, build_session_load

    spec = SessionLoadSpec(str(opts.sessions), num_sessions=opts.num_sessions, session_rate=opts.session_rate,
                           length_scale=opts.session_length_scale, time_scale=opts.time_scale, seed=opts.seed,
                           duration_s=opts.load_duration_s, drain_s=opts.load_drain_s)
    plan = build_session_load(spec, key_prefix=f"demo-{run_id}")
    for line in plan.description:
        console.print(f"  {line}")
    console.print(f"  the server's KV retention between turns: {opts.kv_retention} (--kv-retention)")
    return spec, plan


def _load(server: TracedServer, spec: Any, plan: Any, opts: DemoOptions, run_id: str,
          console: Console) -> tuple[int, int]:
    if opts.sessions:
        return _session_load(server, spec, plan, opts, run_id, console)
    _step(console, 3, f"replaying {len(plan.requests)} requests (at most {opts.load_duration_s:.0f} s "
                      f"+ {opts.load_drain_s:.0f} s drain)")
    assert server.url is not None  # start() returned
    before = os.getloadavg()[0]
    result = run_load(plan, spec, url=server.url, model=demo_model(opts), store=opts.store, run_id=run_id,
                      console=console)
    num_ok = sum(1 for o in result.outcomes if o.ok)
    failed = len(result.outcomes) - num_ok
    if not console.is_terminal:  # the progress table's last line ends without a newline when not on a terminal
        console.print()
    console.print(f"  {len(result.outcomes)} sent, {num_ok} completed, {failed} failed or cut; machine load "
                  f"average {before:.1f} before the load, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    return len(result.outcomes), num_ok


def _session_load(server: TracedServer, spec: Any, plan: Any, opts: DemoOptions, run_id: str,
                  console: Console) -> tuple[int, int]:
    from tokentrace.app.demo.sessions import run_session_load

    _step(console, 3, f"running {len(plan.sessions)} sessions ({plan.num_turns} turns; at most "
                      f"{opts.load_duration_s:.0f} s + {opts.load_drain_s:.0f} s drain)")
    assert server.url is not None  # start() returned
    result = run_session_load(plan, spec, url=server.url, model=demo_model(opts), store=opts.store, run_id=run_id,
                              console=console)
    num_ok = sum(1 for o in result.outcomes if o.ok)
    if not console.is_terminal:
        console.print()
    console.print(f"  {len(result.outcomes)} turns sent, {num_ok} completed, {len(result.outcomes) - num_ok} "
                  f"failed or cut")
    return len(result.outcomes), num_ok


def _serve_and_load(opts: DemoOptions, spec: Any, plan: Any, run_id: str, workdir: Path,
                    console: Console) -> tuple[int, int, int | None]:
    server_spec = ServerSpec(store=opts.store, run_id=run_id, tenants_file=write_tenants_file(workdir),
                             model=demo_model(opts), block_size=getattr(spec, "block_size", opts.block_size),
                             device=opts.device, speculative=opts.speculative, kv_retention=opts.kv_retention)
    server = TracedServer(server_spec, log_path=workdir / "server.stderr.log")
    speculating = (f", speculative decoding on (draft: {_DRAFT_WORDS.get(opts.speculative, opts.speculative)})"
                   if opts.speculative else "")
    _step(console, 2, f"starting the reference server (disaggregated: 1 prefill + 1 decode worker, model "
                      f"{demo_model(opts)!r}{speculating}) under `tokentrace run --store {opts.store} --run {run_id}`")
    try:
        started = time.monotonic()
        with console.status("  starting: the gateway and two workers load the model ...") as status:
            url = server.start(timeout_s=opts.ready_timeout_s, on_wait=lambda: status.update(
                f"  starting: the gateway and two workers load the model ({time.monotonic() - started:.0f} s; "
                f"at most {opts.ready_timeout_s:.0f} s) ..."))
        console.print(f"  ready at {url} after {time.monotonic() - started:.0f} s (process group {server.pid})")
        sent, ok = _load(server, spec, plan, opts, run_id, console)
    finally:
        code = _stop(server, opts, console)
    return sent, ok, code


def _stop(server: TracedServer, opts: DemoOptions, console: Console) -> int | None:
    """Step 4, also after a failure or a Ctrl-C; a second Ctrl-C kills the server at once."""
    _step(console, 4, "stopping the server (SIGINT, forwarded to every process) so every process flushes")
    try:
        with console.status("  waiting for the gateway and workers to exit (Ctrl-C again to kill) ..."):
            code = server.stop(grace_s=opts.stop_grace_s)
    except KeyboardInterrupt:
        console.print("  [yellow]killing the server[/] (its last unflushed rows are lost)")
        code = server.kill()
    console.print(f"  server exited with status {code}" + (" (clean: every process flushed)" if code == 0 else ""))
    return code


def run_demo(opts: DemoOptions, *, console: Console | None = None) -> DemoResult:
    """Run steps 1-5 (see the module doc) and, if ``opts.dashboard``, step 6 until Ctrl-C.

    Blocks for minutes. ``ValueError`` for bad options or a missing trace;
    ``tokentrace.app.demo.server.ServerStartError`` when the server does not start;
    ``KeyboardInterrupt`` passes through after every started process was stopped.
    """
    from tokentrace.app.report import make_report

    console = console or Console()
    run_id = _run_id(opts)
    spec, plan = _plan(opts, run_id, console)
    with tempfile.TemporaryDirectory(prefix="tokentrace-demo-") as tmp:
        try:
            sent, ok, code = _serve_and_load(opts, spec, plan, run_id, Path(tmp), console)
        except KeyboardInterrupt:
            console.print(f"\n[yellow]interrupted[/]: every process the demo started is stopped; what was "
                          f"recorded is in {opts.store.resolve() / run_id} "
                          f"(tokentrace report {opts.store} --run {run_id})")
            raise
    _step(console, 5, "report")
    report = make_report(opts.store, run_id)
    print_report(report, console)
    for line in saturation_lines(report, opts.time_scale):
        console.print(line)
    run_path = opts.store.resolve() / run_id
    console.print(f"\nstore: [bold]{run_path}[/]\n  full report:  tokentrace report {opts.store} --run {run_id}"
                  f"\n  inspect:      tokentrace inspect {opts.store} --run {run_id}")
    result = DemoResult(run_id, run_path, report, sent, ok, code)
    if opts.dashboard:
        _step(console, 6, "dashboard")
        serve_dashboard(opts.store, port=opts.port, console=console, run_id=run_id)
    else:
        console.print(f"\nbrowse it: tokentrace dashboard {opts.store} --port {opts.port}")
    return result


def quiet_request_log() -> None:
    """Keep the web server's one line per request (every Dash callback is a POST) out of the terminal,
    where it would bury the report; its warnings and errors still show."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)


def serve_dashboard(store: Path, *, port: int, console: Console, run_id: str | None = None) -> None:
    """Serve the dashboard of ``store`` on 127.0.0.1:``port`` until Ctrl-C (blocks; returns on Ctrl-C).

    The analyses of ``run_id`` (default: the newest run) are computed ahead in a
    background thread; on Ctrl-C that thread is joined before returning, since
    an interpreter that exits while DuckDB still runs a query in a daemon thread
    aborts.
    """
    from dashboard.app import create_app
    from dashboard.components.shell import SOURCE_KEY

    app = create_app(store)
    try:
        warming = app.server.config[SOURCE_KEY].warm(run_id)
    except ValueError:  # no run in the store: the pages say so
        warming = None
    console.print(f"  dashboard: [bold]http://127.0.0.1:{port}/[/] (Ctrl-C to stop)")
    quiet_request_log()
    try:
        app.run(host="127.0.0.1", port=port, debug=False)
    except KeyboardInterrupt:
        pass
    if warming is not None and warming.is_alive():
        with console.status("  finishing the background analysis ..."):
            warming.join()
    console.print("  dashboard stopped")
