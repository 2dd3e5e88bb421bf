"""A bench run: send a plan's requests, from this process or from several, and record what was seen.

:func:`run_bench` sends the plan with :func:`~tokentrace.app.bench.dispatch.dispatch` (open-loop
offsets, closed-loop bound, duration and drain bounds: see there), either on an event loop
of this process (``processes=0``) or from that many sender processes
(:mod:`~tokentrace.app.bench.senders`), in which case this process only records and reports.
Either way the result is the same: one outcome per request sent, in send order, one run
start (:attr:`BenchRun.start_ns`: request ``i`` was due at ``start + offset_i``), and one
``client`` instance in the store.

How late each request actually went out (its *send lag*) is in the summary: under an open
loop a client that cannot keep up would otherwise under-drive the server without saying so.

Every outcome goes to a :class:`~tokentrace.recorder.Recorder` (instance role ``client``):
the request row (key = the ``X-Request-Id`` sent, arrival = send time, first token,
finish, status, error kind) and one token row per received token with ``recv_ns``; all on
this host's monotonic clock, which the server processes on the same host share.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokentrace.app.bench.client import FailureKind, Outcome, RequestOptions
from tokentrace.app.bench.dispatch import RunLimits, dispatch
from tokentrace.app.bench.plan import Plan
from tokentrace.app.bench.progress import NullProgress, ProgressListener
from tokentrace.app.bench.requests import PlannedRequest
from tokentrace.recorder import BufferedRecorder, Recorder
from tokentrace.schema import RequestStatus, Role
from tokentrace.store.manifest import read_manifest
from tokentrace.store.writer import StoreWriter

__all__ = ["RunLimits", "BenchRun", "OutcomeCollector", "record_outcome", "open_recorder", "run_bench", "status_of"]

BENCH_CONFIG_KEY = "bench"
"""Key of the bench's settings (workload, scaling, arrivals, tenants) in the run manifest's config."""

CANCELLED_ERROR = "cancelled_at_duration_bound"
"""Error text of requests cut by the duration bound (status aborted)."""


@dataclass(frozen=True, slots=True)
class BenchRun:
    """A finished run: outcomes in send order, where they were stored, and the recorder's counters."""

    outcomes: tuple[Outcome, ...]
    num_planned: int
    run_id: str | None = None
    run_path: Path | None = None
    counters: dict[str, int] = field(default_factory=dict)
    config_recorded: bool = False  # the bench settings are in the run manifest's merged config
    start_ns: int = -1  # the dispatcher's start (monotonic ns): request i is due at start_ns + offset_i
    num_processes: int = 0  # sender processes (0: sent from the calling process)


def status_of(outcome: Outcome) -> RequestStatus:
    """The store's status code for an outcome."""
    if outcome.cancelled:
        return RequestStatus.ABORTED
    if outcome.failure is None:
        return RequestStatus.OK
    if outcome.failure is FailureKind.TIMEOUT:
        return RequestStatus.TIMEOUT
    if outcome.failure is FailureKind.HTTP_4XX:
        return RequestStatus.REJECTED
    return RequestStatus.ERROR


def record_outcome(recorder: Recorder, req: PlannedRequest, outcome: Outcome) -> None:
    """Write one request row and its token rows (event-loop thread; never blocks or raises)."""
    num_prompt = outcome.num_prompt_tokens if outcome.num_prompt_tokens >= 0 else req.text.num_prompt_tokens
    rid = recorder.request_begin(req.key, tenant=req.tenant, slo_class=req.slo_class,
                                 arrival_ns=outcome.send_ns, num_prompt_tokens=num_prompt, session=req.session,
                                 session_turn=req.session_turn)
    for i, t_ns in enumerate(outcome.recv_ns):
        recorder.token(rid, i, recv_ns=t_ns)
    error = CANCELLED_ERROR if outcome.cancelled else (outcome.failure.label if outcome.failure else "")
    num_out = outcome.num_output_tokens if outcome.num_output_tokens >= 0 else len(outcome.recv_ns)
    recorder.request_end(rid, finish_ns=outcome.finish_ns, status=status_of(outcome),
                         first_token_ns=outcome.recv_ns[0] if outcome.recv_ns else -1,
                         num_output_tokens=num_out, num_cached_tokens=outcome.num_cached_tokens, error=error)


class OutcomeCollector:
    """The dispatch listener of a run (plain or sessions): records each outcome and tells the progress display."""

    def __init__(self, recorder: Recorder | None, progress: ProgressListener) -> None:
        self.recorder = recorder
        self.progress = progress

    def on_sent(self, req: PlannedRequest) -> None:
        self.progress.on_sent(req)

    def on_done(self, req: PlannedRequest, outcome: Outcome) -> None:
        if self.recorder is not None:
            record_outcome(self.recorder, req, outcome)
        self.progress.on_done(outcome)


def open_recorder(store: str | Path, *, run_id: str | None, config: dict[str, Any]) -> Recorder:
    """A recorder writing to ``store`` as instance role ``client``; its config goes into the run manifest."""
    writer = StoreWriter(store, run_id=run_id, config=config)
    recorder = BufferedRecorder(writer, instance_id=writer.instance_id)
    recorder.instance(role=Role.CLIENT, name="bench-client")
    return recorder


def run_bench(plan: Plan, opts: RequestOptions, limits: RunLimits, *, store: str | Path | None = None,
              run_id: str | None = None, progress: ProgressListener | None = None,
              config: dict[str, Any] | None = None, run_config: dict[str, Any] | None = None,
              processes: int = 0) -> BenchRun:
    """Run the plan; record into ``store`` if given. Blocks until done.

    ``processes``: 0 sends from a fresh event loop in this process; N >= 1 from N sender
    processes while this one records and reports (see :mod:`~tokentrace.app.bench.senders`).
    ``config`` (JSON-ready) is written into the run's manifest, under the bench's
    key, together with the plan's own config (workload, scaling, arrivals, tenants);
    ``run_config`` goes in at the top level, for what describes the whole run (e.g.
    the server's tenant weights that the tenants analyzer reads). ``ValueError`` for
    a bad ``processes`` (or a ``concurrency`` smaller than it); ``OSError`` if the store
    cannot be written; request failures never raise (they are counted).
    """
    if processes < 0:
        raise ValueError(f"processes must be >= 0, got {processes}")
    if processes:
        from tokentrace.app.bench.senders import shard_limits

        shard_limits(limits, processes)  # bad settings fail before anything is written
    recorder = None
    if store is not None:
        recorder = open_recorder(store, run_id=run_id, config={
            **(run_config or {}), BENCH_CONFIG_KEY: {**plan.config, **(config or {}), "processes": processes}})
    collector = OutcomeCollector(recorder, progress or NullProgress())
    try:
        if processes:
            from tokentrace.app.bench.senders import run_in_processes

            outcomes, start_ns = run_in_processes(plan.requests, opts, limits, processes=processes,
                                                  listener=collector)
        else:
            outcomes, start_ns = asyncio.run(dispatch(plan.requests, opts, limits, listener=collector))
    finally:
        if progress is not None:
            progress.close()
        if recorder is not None:
            recorder.close()
    if recorder is None:
        return BenchRun(tuple(outcomes), len(plan.requests), start_ns=start_ns, num_processes=processes)
    sink = recorder.sink
    assert isinstance(sink, StoreWriter)
    # Every writer's config is merged into the run's manifest (the first to name a key wins).
    recorded = BENCH_CONFIG_KEY in read_manifest(sink.run_path).get("config", {})
    return BenchRun(tuple(outcomes), len(plan.requests), sink.run_id, sink.run_path, recorder.counters, recorded,
                    start_ns, processes)
