"""Sender processes (real child processes, loopback server): the plan dealt between them, one
start, outcomes merged into one client instance, the bounds, a Ctrl-C and a dead sender."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from tokentrace.app.bench.arrivals import Arrivals
from tokentrace.app.bench.client import Outcome, RequestOptions
from tokentrace.app.bench.plan import build_plan
from tokentrace.app.bench.progress import ProgressState
from tokentrace.app.bench.requests import PlannedRequest
from tokentrace.app.bench.runner import CANCELLED_ERROR, RunLimits, run_bench
from tokentrace.app.bench.senders import SenderFailed, shard_limits
from tokentrace.app.bench.summary import summarize
from tokentrace.app.bench.synthetic import LengthDist, SyntheticSpec
from tokentrace.schema import REQUESTS, TOKENS, RequestStatus, Role, col
from tokentrace.store import open_run

SPEC = SyntheticSpec(LengthDist("fixed", 16), LengthDist("fixed", 4))


def _senders() -> set[str]:
    return {p.name for p in multiprocessing.active_children() if p.name.startswith("tokentrace-bench-sender-")}


class Watching(ProgressState):
    """Progress that also notes which sender processes are alive when each request is reported sent."""

    def __init__(self, total: int) -> None:
        super().__init__(total)
        self.seen_senders: set[str] = set()

    def on_sent(self, req: PlannedRequest) -> None:
        super().on_sent(req)
        self.seen_senders |= _senders()

    def close(self) -> None:
        pass


def test_the_closed_loop_bound_is_split_between_the_processes():
    limits = RunLimits(duration_s=5, concurrency=7)
    assert [s.concurrency for s in shard_limits(limits, 3)] == [3, 2, 2]
    assert shard_limits(RunLimits(duration_s=5), 2) == [RunLimits(duration_s=5)] * 2
    with pytest.raises(ValueError, match="at least --processes"):
        shard_limits(RunLimits(duration_s=5, concurrency=2), 3)
    with pytest.raises(ValueError, match="processes"):
        run_bench(build_plan(synthetic=SPEC, max_requests=1), RequestOptions("http://127.0.0.1:1"),
                  limits, processes=-1)


def test_three_processes_send_every_request_once_into_one_client_instance(fake_url, tmp_path):
    plan = build_plan(synthetic=SPEC, max_requests=10, arrivals=Arrivals("constant", 20.0), key_prefix="mp")
    progress = Watching(10)
    result = run_bench(plan, RequestOptions(fake_url, model="ok"), RunLimits(duration_s=20), store=tmp_path,
                       run_id="mp", progress=progress, processes=3)
    assert progress.seen_senders == {f"tokentrace-bench-sender-{i}" for i in range(3)}
    assert not _senders()  # all gone once the run is over
    assert (progress.sent, progress.completed, progress.failed) == (10, 10, 0)
    assert sorted(o.key for o in result.outcomes) == sorted(r.key for r in plan.requests)
    assert all(o.ok and len(o.recv_ns) == 4 for o in result.outcomes)
    sends = [o.send_ns for o in result.outcomes]
    assert sends == sorted(sends)  # merged in send order
    for o in result.outcomes:  # one start for every process: none sent before its due time
        assert o.send_ns >= result.start_ns + round(plan.requests[o.index].offset_s * 1e9)
    assert result.num_processes == 3 and result.config_recorded
    run = open_run(tmp_path, "mp")
    assert [i["role"] for i in run.instances()] == [Role.CLIENT.label]
    assert run.manifest["config"]["bench"]["processes"] == 3
    req = run.table(REQUESTS.name).to_pandas().set_index(col.REQUEST_KEY)
    assert len(req) == 10 and set(req[col.STATUS]) == {int(RequestStatus.OK)}
    for o in result.outcomes:
        assert req.loc[o.key, col.ARRIVAL_NS] == o.send_ns and req.loc[o.key, col.FIRST_TOKEN_NS] == o.recv_ns[0]
    assert sorted(run.table(TOKENS.name).column(col.RECV_NS).to_pylist()) == sorted(
        t for o in result.outcomes for t in o.recv_ns)
    summary = summarize(plan.requests, result.outcomes, start_ns=result.start_ns)
    assert summary.completed == 10 and summary.total_output_tokens == 40 and len(summary.send_lag_ms) == 10


def test_more_processes_than_requests(fake_url):
    plan = build_plan(synthetic=SPEC, max_requests=2)
    result = run_bench(plan, RequestOptions(fake_url, model="ok"), RunLimits(duration_s=20), processes=4)
    assert sorted(o.index for o in result.outcomes) == [0, 1] and all(o.ok for o in result.outcomes)


def test_concurrency_bounds_requests_in_flight_across_processes(recording_server):
    url, _, counters = recording_server
    plan = build_plan(synthetic=SPEC, max_requests=16)
    result = run_bench(plan, RequestOptions(url, model="ok"), RunLimits(duration_s=20, concurrency=3), processes=2)
    assert len(result.outcomes) == 16 and all(o.ok for o in result.outcomes)
    assert counters.max_in_flight <= 3


def test_the_duration_bound_cancels_what_is_in_flight_in_every_process(fake_url, tmp_path):
    plan = build_plan(synthetic=SPEC, max_requests=50, arrivals=Arrivals("constant", 10.0))
    result = run_bench(plan, RequestOptions(fake_url, model="slow"), RunLimits(duration_s=0.45, drain_s=0.2),
                       store=tmp_path, run_id="short", processes=2)
    assert 3 <= len(result.outcomes) <= 6  # sends at 0, 0.1, ..., 0.4 s; nothing after the bound
    assert all(o.cancelled and len(o.recv_ns) == 1 for o in result.outcomes)
    req = open_run(tmp_path, "short").table(REQUESTS.name).to_pandas()
    assert len(req) == len(result.outcomes) and set(req[col.ERROR]) == {CANCELLED_ERROR}


class Interrupting(ProgressState):
    """Raises KeyboardInterrupt (a Ctrl-C) when the first outcome comes back."""

    raised = False

    def on_done(self, outcome: Outcome) -> None:
        super().on_done(outcome)
        if not self.raised:
            self.raised = True
            raise KeyboardInterrupt

    def close(self) -> None:
        pass


def test_a_ctrl_c_stops_the_senders_and_keeps_what_they_reported(fake_url, tmp_path):
    plan = build_plan(synthetic=SPEC, max_requests=60, arrivals=Arrivals("constant", 10.0))  # 6 s of sends
    progress = Interrupting(60)
    with pytest.raises(KeyboardInterrupt):
        run_bench(plan, RequestOptions(fake_url, model="ok"), RunLimits(duration_s=30), store=tmp_path,
                  run_id="ctrl-c", progress=progress, processes=2)
    assert not _senders()
    req = open_run(tmp_path, "ctrl-c").table(REQUESTS.name).to_pandas()
    assert 1 <= len(req) < 60 and len(req) == progress.sent  # every request sent is recorded
    assert set(req[col.STATUS]) <= {int(RequestStatus.OK), int(RequestStatus.ABORTED)}


class Killing(ProgressState):
    """Kills one sender process (SIGKILL) as soon as the first request is reported sent."""

    def on_sent(self, req: PlannedRequest) -> None:
        super().on_sent(req)
        if self.sent == 1:
            victim = next(p for p in multiprocessing.active_children() if p.name == "tokentrace-bench-sender-0")
            os.kill(victim.pid, signal.SIGKILL)

    def close(self) -> None:
        pass


def test_a_sender_that_dies_fails_the_run_and_the_others_are_stopped(fake_url, tmp_path):
    plan = build_plan(synthetic=SPEC, max_requests=60, arrivals=Arrivals("constant", 10.0))
    with pytest.raises(SenderFailed, match="tokentrace-bench-sender-0"):
        run_bench(plan, RequestOptions(fake_url, model="ok"), RunLimits(duration_s=30), store=tmp_path,
                  run_id="dead", progress=Killing(60), processes=2)
    assert not _senders()
    assert len(open_run(tmp_path, "dead").table(REQUESTS.name)) < 60
