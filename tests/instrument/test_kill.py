"""SIGKILL under load, one process kind at a time and the whole traced deployment at once.

A deployment runs under ``tokentrace run`` as its own process group while client threads keep
streaming completions. Killing a worker must not stop the service; killing the gateway must
not leave workers behind; and whatever is killed, the next reader recovers its crash journal:
every event older than 1 s before its SIGKILL is in the store (``docs/reliability.md``).

The loss is measured two ways: per traced process, the kill time minus its last recorded
event (it serves continuously up to the kill, so a larger gap is lost events); and from the
client, every stream chunk it received more than 1 s before the kill has its token in the
store. No test asserts how fast anything runs: only what survived.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pyarrow.compute as pc
import pytest

from tokentrace.schema import REQUESTS, SPANS, STEPS, TOKENS, col, request_id_of
from tokentrace.store import open_run

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
BUDGET_NS = 1_000_000_000  # at most 1 s of events lost
BODY = {"model": "tiny", "prompt": "keep the deployment busy while it dies", "max_tokens": 30, "ignore_eos": True,
        "stream": True}


@dataclass
class Deployment:
    """A traced reference deployment (its own process group) and its processes by name."""

    proc: subprocess.Popen
    url: str
    store: Path
    run: str
    stderr: list[str] = field(default_factory=list)  # drained by a thread: a full pipe would block the server

    def launcher_pid(self) -> int:
        (pid,) = _children(self.proc.pid)
        return pid

    def worker_pids(self) -> dict[str, int]:
        out = {}
        for pid in _children(self.launcher_pid()):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            out[argv[argv.index(b"--name") + 1].decode()] = pid
        return out


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Whether any thread of ``pid`` still runs. A killed process's main thread shows as a zombie
    while its other threads may still be exiting, holding its files (and their locks) open."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


@contextmanager
def deployment(store: Path, run: str, args: list[str]) -> Iterator[Deployment]:
    cmd = [sys.executable, "-c", "from tokentrace.app.cli import main; main()", "run", "--store", str(store), "--run",
           run, "--", sys.executable, "-m", "reference_server", "--port", "0", "--model", "tiny", "--device", "cpu",
           "--block-size", "4", "--num-device-blocks", "512", "--delay", "decode_step=4ms",
           "--no-restart-workers", *args]  # a killed worker stays dead: the writers counted are the ones killed
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("READY "), (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        dep = Deployment(proc, line.split()[1], store, run)
        for pipe, keep in ((proc.stdout, []), (proc.stderr, dep.stderr)):
            threading.Thread(target=lambda p=pipe, k=keep: k.extend(p), daemon=True).start()
        yield dep
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@dataclass
class Load:
    """Client threads keeping streams in flight; each chunk's arrival per request key."""

    url: str
    num_streams: int = 4
    chunks: dict[str, list[int]] = field(default_factory=dict)  # key -> client monotonic ns of each chunk
    completed_after: dict[str, int] = field(default_factory=dict)  # key -> when a stream finished whole
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.num_streams)]
        for t in self._threads:
            t.start()
        return self

    def _run(self, worker: int) -> None:
        n = 0
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                key = f"w{worker}-{n}"
                n += 1
                times: list[int] = []
                self.chunks[key] = times
                try:
                    with http.stream("POST", f"{self.url}/v1/completions", json=BODY,
                                     headers={"X-Request-Id": key}) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                times.append(time.monotonic_ns())
                            elif line == "data: [DONE]":
                                self.completed_after[key] = time.monotonic_ns()
                except httpx.HTTPError:
                    if self._stop.is_set():
                        return
                    time.sleep(0.05)  # the gateway is gone or a worker died mid-stream: try again

    def completions_since(self, t_ns: int) -> int:
        return sum(1 for done in list(self.completed_after.values()) if done > t_ns)

    def wait_for_completions(self, count: int, since_ns: int, timeout_s: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.completions_since(since_ns) < count and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the client threads' progress
        return self.completions_since(since_ns) >= count

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def _wait_for_part(run_dir: Path, table: str, timeout_s: float = 120.0) -> None:
    """Until some process has written a Parquet part of ``table`` (a flush with its fixed cost)."""
    deadline = time.monotonic() + timeout_s
    while not list((run_dir / table).glob("instance=*/part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.05)  # polls the store; nothing is being simulated
    assert list((run_dir / table).glob("instance=*/part-*.parquet")), f"no {table} part within {timeout_s} s"


def _last_event_ns(run) -> dict[str, int]:
    """Per traced instance name: its latest recorded event time (its own monotonic clock, ns)."""
    names = {i["instance"]: i["name"] for i in run.instances()}
    last: dict[str, int] = {}
    for table, columns in ((SPANS, (col.END_NS,)), (TOKENS, (col.EMIT_NS, col.SENT_NS)), (STEPS, (col.END_NS,)),
                           (REQUESTS, (col.FINISH_NS,))):
        data = run.table(table.name, columns=[col.INSTANCE_ID, *columns])
        for instance_id in set(data.column(col.INSTANCE_ID).to_pylist()):
            rows = data.filter(pc.equal(data.column(col.INSTANCE_ID), instance_id))
            for c in columns:
                hi = pc.max(rows.column(c)).as_py()
                if hi is not None:
                    name = names.get(instance_id, str(instance_id))
                    last[name] = max(last.get(name, 0), hi)
    return last


def _client_chunks_missing(run, load: Load, before_ns: int) -> list[str]:
    """Requests whose chunks received before ``before_ns`` outnumber the gateway's tokens rows."""
    tokens = run.table(TOKENS.name, columns=[col.REQUEST_ID, col.SENT_NS])
    sent = tokens.filter(pc.is_valid(tokens.column(col.SENT_NS))).column(col.REQUEST_ID).to_pylist()
    per_request: dict[int, int] = {}
    for rid in sent:
        per_request[rid] = per_request.get(rid, 0) + 1
    missing = []
    for key, times in list(load.chunks.items()):
        seen = sum(1 for t in list(times) if t < before_ns)
        if per_request.get(request_id_of(key), 0) < seen:
            missing.append(f"{key}: {seen} chunks before, {per_request.get(request_id_of(key), 0)} tokens stored")
    return missing


def _wait_dead(pids: dict[str, int]) -> None:
    """Until every thread of every process is gone (a reader can only recover a dead writer)."""
    for name, pid in pids.items():
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"{name} outlived its SIGKILL"


def _wait_until_serving(url: str, instance: str, timeout_s: float = 120.0) -> int:
    """Until the gateway's /metrics shows ``instance`` has served (taken prompt tokens or KV); the time it was
    first seen doing so (so its kill can wait until it has served for longer than the budget)."""
    counters = ("reference_server_prefix_cache_query_tokens_total", "reference_server_kv_transfer_sent_bytes_total",
                "reference_server_kv_transfer_received_bytes_total")
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10) as http:
        while time.monotonic() < deadline:
            for line in http.get(f"{url}/metrics").text.splitlines():
                if (line.startswith(counters) and f'instance="{instance}"' in line
                        and float(line.rsplit(" ", 1)[1]) > 0):
                    return time.monotonic_ns()
            time.sleep(0.05)  # polls the gateway's counters
    raise AssertionError(f"{instance} served nothing within {timeout_s} s")


def _kill(pid: int) -> int:
    t = time.monotonic_ns()  # the host's monotonic clock: the same one every traced process records on
    os.kill(pid, signal.SIGKILL)
    return t


def test_killing_each_worker_kind_and_then_the_whole_deployment_loses_at_most_a_second(tmp_path):
    with deployment(tmp_path, "disagg", ["--mode", "disagg", "--prefill", "2", "--decode", "2",
                                         "--router", "load"]) as dep:  # every worker busy until killed
        pids = {**dep.worker_pids(), "gateway": dep.launcher_pid()}
        load = Load(dep.url).start()
        try:
            _wait_for_part(tmp_path / "disagg", TOKENS.name)  # parts are being written: flushes are under way
            killed: dict[str, int] = {}
            for victim in ("prefill-0", "decode-0"):
                # A victim killed less than the budget after its first request may rightly have nothing stored
                # (all it recorded is younger than 1 s): it serves for longer than that first.
                serving_since = _wait_until_serving(dep.url, victim)
                assert load.wait_for_completions(4, since_ns=serving_since + BUDGET_NS), f"stalled before {victim}"
                killed[victim] = _kill(pids[victim])
                # The service goes on: streams finish on the workers left (redispatched if they were on it).
                assert load.wait_for_completions(4, since_ns=killed[victim] + 500_000_000), f"stalled after {victim}"
            time.sleep(2.0)  # 2 s of events after the last part any process may have written: journal only
            killed_all = time.monotonic_ns()
            os.killpg(dep.proc.pid, signal.SIGKILL)  # tokentrace run, the gateway and the workers left, at once
            dep.proc.wait(timeout=60)
        finally:
            load.stop()
    _wait_dead(pids)
    run = open_run(tmp_path, "disagg")  # recovers every killed process's crash journal
    last = _last_event_ns(run)
    assert {"prefill-0", "prefill-1", "decode-0", "decode-1"} <= set(last), (last, dep.stderr[-20:])
    gateway = next(name for name in last if name.startswith("gateway"))
    lost_ns = {**{v: t - last[v] for v, t in killed.items()},
               **{n: killed_all - last[n] for n in (gateway, "prefill-1", "decode-1")}}
    assert all(gap <= BUDGET_NS for gap in lost_ns.values()), (
        {n: f"{g / 1e9:.3f} s" for n, g in lost_ns.items()}, dep.stderr[-20:])
    assert _client_chunks_missing(run, load, killed_all - BUDGET_NS) == []
    writers = run.manifest["writers"]
    assert len(writers) == 5 and all(w["ended_without_closing"] and not w["closed"] for w in writers)  # all killed
    assert sum(sum(w["recovered_rows"].values()) for w in writers) > 0


def test_killing_a_colocated_worker_and_then_the_gateway_leaves_no_process_and_no_loss(tmp_path):
    with deployment(tmp_path, "colo", ["--mode", "colocated", "--instances", "2", "--router", "load"]) as dep:
        pids = dep.worker_pids()
        launcher = dep.launcher_pid()
        load = Load(dep.url).start()
        try:
            assert load.wait_for_completions(4, since_ns=0)
            # Both workers serve for longer than the budget before the kill, so colocated-0 has events
            # more than 1 s old that must be in the store. Killed as soon as the first streams end
            # (about 0.3 s after the deployment is ready: one journal interval into its recording),
            # it may rightly have nothing stored yet, since all it recorded was younger than 1 s.
            serving_since = time.monotonic_ns()
            assert load.wait_for_completions(4, since_ns=serving_since + BUDGET_NS), "stalled before the kill"
            killed_worker = _kill(pids["colocated-0"])
            assert load.wait_for_completions(4, since_ns=killed_worker + 500_000_000), "stalled after the kill"
            killed_gateway = _kill(launcher)
            assert dep.proc.wait(timeout=60) == 128 + signal.SIGKILL  # tokentrace run reports how its child died
        finally:
            load.stop()
    _wait_dead({"gateway": launcher, **pids})  # colocated-1 sees its controller connection close and exits

    run = open_run(tmp_path, "colo")
    last = _last_event_ns(run)
    assert {"colocated-0", "colocated-1"} <= set(last), (last, dep.stderr[-20:])
    gateway = next(name for name in last if name.startswith("gateway"))
    assert killed_worker - last["colocated-0"] <= BUDGET_NS
    assert killed_gateway - last[gateway] <= BUDGET_NS
    by_name = {i["name"]: i["writer"] for i in run.instances()}
    fragments = {w["writer"]: w for w in run.manifest["writers"]}
    assert fragments[by_name["colocated-1"]]["closed"]  # exited on its own, flushed at exit
    assert fragments[by_name["colocated-0"]]["ended_without_closing"]
    assert _client_chunks_missing(run, load, killed_gateway - BUDGET_NS) == []


@contextmanager
def busy_loops(num: int) -> Iterator[None]:
    """``num`` processes spinning on the CPU (each ends by itself after 5 minutes at most), killed on exit."""
    code = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    pass\n"
    loops = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(num)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def test_killing_the_whole_deployment_with_two_busy_loops_loses_at_most_a_second(tmp_path):
    # Twice as many runnable processes as a 2-core machine has cores: the flush threads get the CPU only part
    # of the time, and the crash journal must still hold every event older than the budget.
    with busy_loops(2), deployment(tmp_path, "busy", ["--mode", "disagg", "--router", "load"]) as dep:
        pids = {**dep.worker_pids(), "gateway": dep.launcher_pid()}
        load = Load(dep.url).start()
        try:
            _wait_for_part(tmp_path / "busy", TOKENS.name)
            time.sleep(2.0)  # events after the last part: in the journal only
            killed = time.monotonic_ns()
            os.killpg(dep.proc.pid, signal.SIGKILL)
            dep.proc.wait(timeout=60)
        finally:
            load.stop()
    _wait_dead(pids)
    run = open_run(tmp_path, "busy")
    last = _last_event_ns(run)
    assert {"prefill-0", "decode-0"} <= set(last), (last, dep.stderr[-20:])
    lost = {name: killed - t for name, t in last.items()}
    assert all(gap <= BUDGET_NS for gap in lost.values()), {n: f"{g / 1e9:.3f} s" for n, g in lost.items()}
    assert _client_chunks_missing(run, load, killed - BUDGET_NS) == []
