"""The store under several processes: concurrent writers, a forked child, SIGKILL mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from tokentrace.schema import SPANS, STEPS, col
from tokentrace.store import open_run

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


_CHILD = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    from tokentrace.schema import SPANS
    from tokentrace.store import StoreWriter

    store, tag, num_parts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    w = StoreWriter(store, run_id="shared", config={"writer": tag})
    w.register_instance(tag, "decode", f"decode-{tag}")
    for k in range(num_parts):
        rows = {n: [tag] * 50 for n in SPANS.names}
        w.write(SPANS, pa.RecordBatch.from_pydict(rows))
        w.update_counters({"dropped": k + 1})
    w.close()
    """
)


def test_two_processes_write_one_run_at_the_same_time(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), str(tag), "20"], env=ENV, stderr=subprocess.PIPE)
        for tag in (1, 2)
    ]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    run = open_run(tmp_path)
    spans = run.table(SPANS.name)
    assert spans.num_rows == 2 * 20 * 50
    assert sorted(set(spans.column(0).to_pylist())) == [1, 2]
    assert len(list((tmp_path / "shared" / SPANS.name).iterdir())) == 2  # one partition per process
    assert run.counters()["dropped"] == 40  # 20 + 20, the last totals of each process
    assert [i["name"] for i in run.instances()] == ["decode-1", "decode-2"]
    assert all(frag["closed"] for frag in run.manifest["writers"])
    assert run.manifest["config"]["writer"] in (1, 2)


_FORKING_CHILD = """
import os, sys
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import Role, Stage
from tokentrace.store import StoreWriter

w = StoreWriter(sys.argv[1], run_id="forked")
rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=0.2)
rec.instance(role=Role.PREFILL, name="parent")
pid = os.fork()
if pid == 0:
    rec.instance(role=Role.DECODE, name="child")
    for i in range(100):
        rec.span(2, Stage.DECODE_COMPUTE, i, i + 1)
    rec.close()
    os._exit(0)
for i in range(50):
    rec.span(1, Stage.PREFILL_COMPUTE, i, i + 1)
_, status = os.waitpid(pid, 0)
rec.close()
print(status, w.instance_id)
"""


def test_a_forked_child_writes_its_own_partition_of_the_same_run(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _FORKING_CHILD, str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    status, parent_id = map(int, done.stdout.split())
    assert status == 0
    run = open_run(tmp_path)
    writers = {frag["writer"]: frag for frag in run.manifest["writers"]}
    (child_id,) = set(writers) - {parent_id}
    assert writers[child_id]["parent_writer"] == parent_id and writers[child_id]["pid"] != writers[parent_id]["pid"]
    spans = run.table(SPANS.name, columns=[col.REQUEST_ID, col.INSTANCE_ID])
    by_request = {}
    for row in spans.to_pylist():
        by_request.setdefault(row[col.REQUEST_ID], []).append(row[col.INSTANCE_ID])
    assert by_request[1] == [parent_id] * 50 and by_request[2] == [child_id] * 100
    partitions = sorted(p.name for p in (tmp_path / "forked" / SPANS.name).iterdir())
    assert partitions == sorted(f"instance={i}" for i in (parent_id, child_id))
    assert {i["instance"]: i["name"] for i in run.instances()} == {parent_id: "parent", child_id: "child"}


# --------------------------------------------------------------------------- SIGKILL


_WRITER_CHILD = """
import sys
import numpy as np
import pyarrow as pa
from tokentrace.schema import STEPS, col
from tokentrace.store import StoreWriter

w = StoreWriter(sys.argv[1], run_id="killed")
first, rows = 0, 20_000  # big enough that the child spends most of its time inside write()
noise = np.random.default_rng(0).integers(0, 2**40, rows)  # incompressible: real work for zstd
while True:
    data = {n: noise for n in STEPS.names}
    data[col.STEP] = np.arange(first, first + rows)
    w.write(STEPS, pa.RecordBatch.from_pydict(data))
    first += rows
    print(first, flush=True)  # rows in finished files
"""

_RECORDER_CHILD = """
import sys, time
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import STEPS
from tokentrace.store import StoreWriter

w = StoreWriter(sys.argv[1], run_id="killed")
rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=0.2)
rec.instance(name="victim")
step, seen = 0, 0
while True:
    for _ in range(200):
        t = time.monotonic_ns()
        rec.step(step, t, t + 1, 1, 0, 1, 0, 1, 0)
        step += 1
    written = rec.counters[STEPS.name]  # rows whose sink.write has returned
    if written != seen:
        seen = written
        print(written, flush=True)
    time.sleep(0.001)  # a server does other work between events
"""


def _kill_after(script: str, store: Path, *, num_progress_lines: int, mid_write: bool = False) -> list[int]:
    """Run ``script`` in a child, SIGKILL it after it printed that many lines; all lines printed.

    ``mid_write``: after the lines, wait (up to 10 s) until a temporary part
    file exists, so the kill most likely lands while a file is being written.
    """
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(store)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    printed: list[int] = []
    try:
        while len(printed) < num_progress_lines:
            line = child.stdout.readline()
            if not line:
                pytest.fail(f"child exited early: {child.stderr.read()}")
            printed.append(int(line))
        deadline = time.monotonic() + 10
        while mid_write and time.monotonic() < deadline and not any(store.rglob(".tmp-*")):
            time.sleep(0.0002)  # polling the child's progress, not standing in for work
    finally:
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    return printed + [int(x) for x in rest.split()]


def test_a_writer_killed_mid_write_leaves_only_whole_files(tmp_path):
    printed = _kill_after(_WRITER_CHILD, tmp_path, num_progress_lines=6, mid_write=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a half-written file being read would warn
        steps = open_run(tmp_path).table(STEPS.name, columns=[col.STEP]).column(0).to_pylist()
    # Every acknowledged write is there. (More may be: the flush thread can finish several
    # writes before a starved main thread prints their count.)
    assert printed[-1] <= len(steps)
    assert sorted(steps) == list(range(len(steps)))  # every part whole, none twice


def test_a_recorder_killed_mid_run_keeps_every_completed_flush(tmp_path):
    printed = _kill_after(_RECORDER_CHILD, tmp_path, num_progress_lines=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = open_run(tmp_path)
        steps = run.table(STEPS.name, columns=[col.STEP]).column(0).to_pylist()
        names = [i["name"] for i in run.instances()]
    assert len(steps) >= printed[-1] > 0
    assert len(set(steps)) == len(steps)
    assert names == ["victim"]
