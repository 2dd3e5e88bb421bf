"""The bench run loop: send a plan's requests on time, bounded, and record what was seen.

:func:`run_plan` runs on one asyncio event loop. A dispatcher sends each planned
request at its open-loop offset (and, with ``concurrency``, only while fewer than
that many are in flight: closed loop). The run is bounded twice: by the plan's
length (``--max-requests``) and by ``duration_s``: no request is sent after it,
and requests still in flight ``drain_s`` later are cancelled and recorded as
aborted (what arrived of them is kept).

The run's start (:attr:`BenchRun.start_ns`) is when the dispatcher began, after
the HTTP clients exist; request ``i`` is due at ``start + offset_i``. How late
each one actually went out (its *send lag*) is in the summary: under an open
loop a client that cannot keep up would otherwise under-drive the server
without saying so.

Every outcome goes to a :class:`~tokentrace.recorder.Recorder` (instance role
``client``): the request row (key = the ``X-Request-Id`` sent, arrival = send
time, first token, finish, status, error kind) and one token row per received
token with ``recv_ns``; all on this process's monotonic clock, which the server
processes on the same host share.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokentrace.bench.client import ClientShards, FailureKind, Outcome, RequestOptions, send_request
from tokentrace.bench.plan import Plan
from tokentrace.bench.progress import NullProgress, ProgressListener
from tokentrace.bench.requests import PlannedRequest
from tokentrace.recorder import BufferedRecorder, Recorder
from tokentrace.schema import RequestStatus, Role
from tokentrace.store.manifest import read_manifest
from tokentrace.store.writer import StoreWriter

__all__ = ["RunLimits", "BenchRun", "run_plan", "record_outcome", "open_recorder", "run_bench", "status_of"]

BENCH_CONFIG_KEY = "bench"
"""Key of the bench's settings (workload, scaling, arrivals, tenants) in the run manifest's config."""

CANCELLED_ERROR = "cancelled_at_duration_bound"
"""Error text of requests cut by the duration bound (status aborted)."""


@dataclass(frozen=True, slots=True)
class RunLimits:
    """Bounds of a run. ``concurrency`` 0 = no closed-loop bound."""

    duration_s: float = 600.0  # no request is sent later than this after the start
    drain_s: float = 30.0  # in-flight requests get this long after duration_s, then are cancelled
    concurrency: int = 0

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration_s}")
        if not self.drain_s >= 0:
            raise ValueError(f"drain must be >= 0 s, got {self.drain_s}")
        if self.concurrency < 0:
            raise ValueError(f"concurrency must be >= 0, got {self.concurrency}")


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
                                 arrival_ns=outcome.send_ns, num_prompt_tokens=num_prompt)
    for i, t_ns in enumerate(outcome.recv_ns):
        recorder.token(rid, i, recv_ns=t_ns)
    error = CANCELLED_ERROR if outcome.cancelled else (outcome.failure.label if outcome.failure else "")
    num_out = outcome.num_output_tokens if outcome.num_output_tokens >= 0 else len(outcome.recv_ns)
    recorder.request_end(rid, finish_ns=outcome.finish_ns, status=status_of(outcome),
                         first_token_ns=outcome.recv_ns[0] if outcome.recv_ns else -1,
                         num_output_tokens=num_out, num_cached_tokens=outcome.num_cached_tokens, error=error)


async def run_plan(plan: Plan, opts: RequestOptions, limits: RunLimits, *, recorder: Recorder | None = None,
                   progress: ProgressListener | None = None) -> tuple[list[Outcome], int]:
    """Send the plan (see module doc); the outcomes of the requests sent, in send order, and the
    run's start (monotonic ns; request ``i`` was due at ``start + offset_i``)."""
    listener = progress or NullProgress()
    sem = asyncio.Semaphore(limits.concurrency) if limits.concurrency else None
    tasks: list[tuple[PlannedRequest, asyncio.Task[Outcome]]] = []

    async def one(req: PlannedRequest) -> Outcome:
        try:
            outcome = await send_request(shards.for_request(req.index), req, opts)
        finally:
            if sem is not None:
                sem.release()
        if recorder is not None:
            record_outcome(recorder, req, outcome)
        listener.on_done(outcome)
        return outcome

    async with ClientShards(opts, num_shards=min(limits.concurrency or 64, 64)) as shards:
        start_ns = time.monotonic_ns()  # after the clients exist: building them (SSL context) takes ~40 ms
        start = start_ns / 1e9
        send_deadline = start + limits.duration_s
        for req in plan.requests:
            delay = start + req.offset_s - time.monotonic()
            if start + req.offset_s > send_deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                try:
                    await asyncio.wait_for(sem.acquire(), timeout=max(send_deadline - time.monotonic(), 0))
                except TimeoutError:
                    break
            if time.monotonic() > send_deadline:
                if sem is not None:
                    sem.release()
                break
            listener.on_sent(req)
            tasks.append((req, asyncio.create_task(one(req))))
        if tasks:
            hard_stop = send_deadline + limits.drain_s - time.monotonic()
            _, pending = await asyncio.wait([t for _, t in tasks], timeout=max(hard_stop, 0))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return [_result(req, task, recorder, listener) for req, task in tasks], start_ns


def _result(req: PlannedRequest, task: asyncio.Task[Outcome], recorder: Recorder | None,
            listener: ProgressListener) -> Outcome:
    """The task's outcome; a task cancelled before it could send becomes an empty cancelled outcome."""
    if not task.cancelled():
        return task.result()
    now = time.monotonic_ns()
    outcome = Outcome(req.index, req.key, now, (), now, 0, None, cancelled=True)
    if recorder is not None:
        record_outcome(recorder, req, outcome)
    listener.on_done(outcome)
    return outcome


def open_recorder(store: str | Path, *, run_id: str | None, config: dict[str, Any]) -> Recorder:
    """A recorder writing to ``store`` as instance role ``client``; its config goes into the run manifest."""
    writer = StoreWriter(store, run_id=run_id, config=config)
    recorder = BufferedRecorder(writer, instance_id=writer.instance_id)
    recorder.instance(role=Role.CLIENT, name="bench-client")
    return recorder


def run_bench(plan: Plan, opts: RequestOptions, limits: RunLimits, *, store: str | Path | None = None,
              run_id: str | None = None, progress: ProgressListener | None = None,
              config: dict[str, Any] | None = None, run_config: dict[str, Any] | None = None) -> BenchRun:
    """Run the plan on a fresh event loop; record into ``store`` if given. Blocks until done.

    ``config`` (JSON-ready) is written into the run's manifest, under the bench's
    key, together with the plan's own config (workload, scaling, arrivals, tenants);
    ``run_config`` goes in at the top level, for what describes the whole run (e.g.
    the server's tenant weights that the tenants analyzer reads). ``OSError`` if the
    store cannot be written; request failures never raise (they are counted).
    """
    recorder = None
    if store is not None:
        recorder = open_recorder(store, run_id=run_id, config={
            **(run_config or {}), BENCH_CONFIG_KEY: {**plan.config, **(config or {})}})
    try:
        outcomes, start_ns = asyncio.run(run_plan(plan, opts, limits, recorder=recorder, progress=progress))
    finally:
        if progress is not None:
            progress.close()
        if recorder is not None:
            recorder.close()
    if recorder is None:
        return BenchRun(tuple(outcomes), len(plan.requests), start_ns=start_ns)
    sink = recorder.sink
    assert isinstance(sink, StoreWriter)
    # Every writer's config is merged into the run's manifest (the first to name a key wins).
    recorded = BENCH_CONFIG_KEY in read_manifest(sink.run_path).get("config", {})
    return BenchRun(tuple(outcomes), len(plan.requests), sink.run_id, sink.run_path, recorder.counters, recorded,
                    start_ns)
