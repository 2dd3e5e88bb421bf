"""The crash journal: what a killed writer had handed over is recovered by the next reader,
exactly once; a live writer's journal is never touched; damage and read-only stores are said."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from array import array
from pathlib import Path

import pyarrow as pa
import pytest

from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.buffers import LAYOUTS
from tokentrace.schema import REQUESTS, SPANS, STEPS, col
from tokentrace.store import CorruptFileWarning, StoreWriter, open_run
from tokentrace.store.journal import JOURNAL_DIR, encode_rows, journal_name, read_journal, recover_run

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def steps(first: int, num: int) -> pa.RecordBatch:
    data = {n: list(range(first, first + num)) for n in STEPS.names}
    return pa.RecordBatch.from_pydict(data)


def raw_steps(first: int, num: int) -> tuple[tuple[str, ...], array]:
    """Rows of ``steps`` as the recorder holds them: its layout's fields, packed int64 rows."""
    layout = LAYOUTS[STEPS.name]
    rows = array("q")
    for i in range(first, first + num):
        rows.frombytes(layout.packer.pack(*([i] * layout.width)))
    return layout.fields, rows


def journal_steps(w: StoreWriter, first: int, num: int) -> None:
    fields, rows = raw_steps(first, num)
    w.journal(STEPS, fields, rows, {}, w.instance_id)


def journals(run_dir: Path) -> list[Path]:
    return sorted(run_dir.rglob("journal-*.arrows"))


def journaled_steps(path: Path) -> list[int]:
    data, _ = read_journal(path, STEPS)
    return [] if data is None else data.column(col.STEP).to_pylist()


# --------------------------------------------------------------------------- one process


def test_journaled_rows_wait_for_their_part_whose_write_deletes_the_journal(tmp_path):
    w = StoreWriter(tmp_path, run_id="r")
    journal_steps(w, 0, 3)
    journal_steps(w, 3, 2)
    (journal,) = journals(w.run_path)
    assert journal.name == journal_name(1) and journaled_steps(journal) == [0, 1, 2, 3, 4]
    w.write(STEPS, steps(0, 5))  # the recorder writes the same rows as the part
    assert journals(w.run_path) == []
    journal_steps(w, 5, 1)
    assert [j.name for j in journals(w.run_path)] == [journal_name(2)]  # the next part's journal
    w.write(STEPS, steps(5, 1))
    w.close()
    run = open_run(tmp_path)
    assert run.table(STEPS.name).column(col.STEP).to_pylist() == list(range(6))
    assert [f.name for f in run.files(STEPS.name)] == ["part-000001.parquet", "part-000002.parquet"]
    assert not (w.run_path / JOURNAL_DIR / f"{w.instance_id}.lock").exists()


def test_a_live_writers_journal_is_left_alone_even_by_readers_of_the_same_process(tmp_path):
    w = StoreWriter(tmp_path, run_id="r")
    journal_steps(w, 0, 4)
    report = recover_run(w.run_path)  # another open file description: the writer's flock still wins
    assert report.recovered_rows == {} and len(journals(w.run_path)) == 1
    assert open_run(tmp_path).num_rows(STEPS.name) == 0
    w.close()  # closed without writing them: the next reader recovers them, once
    assert open_run(tmp_path).table(STEPS.name).column(col.STEP).to_pylist() == [0, 1, 2, 3]
    assert open_run(tmp_path).num_rows(STEPS.name) == 4


def test_a_journal_whose_part_was_written_is_dropped_not_read_twice(tmp_path):
    w = StoreWriter(tmp_path, run_id="r")
    journal_steps(w, 0, 2)
    (journal,) = journals(w.run_path)
    kept = journal.read_bytes()
    w.write(STEPS, steps(0, 2))
    w.close()
    journal.write_bytes(kept)  # as if the writer died between writing the part and deleting the journal
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert open_run(tmp_path).table(STEPS.name).column(col.STEP).to_pylist() == [0, 1]
    assert journals(w.run_path) == []


def test_a_torn_last_record_keeps_the_records_before_it_and_says_so(tmp_path):
    run_dir = tmp_path / "r"
    StoreWriter(tmp_path, run_id="r").close()
    partition = run_dir / STEPS.name / "instance=42"
    partition.mkdir(parents=True)
    good = encode_rows(*raw_steps(0, 3), {}, 42)
    (partition / journal_name(1)).write_bytes(good + good[: len(good) // 2])  # died mid-append
    with pytest.warns(CorruptFileWarning, match="ends in a damaged record; the 3 rows before it were recovered"):
        run = open_run(tmp_path)
    steps_read = run.table(STEPS.name, columns=[col.STEP, col.INSTANCE_ID]).to_pylist()
    assert steps_read == [{col.STEP: i, col.INSTANCE_ID: 42} for i in range(3)]
    assert journals(run_dir) == []


def test_journaled_strings_and_nulls_come_back_as_the_recorder_would_write_them(tmp_path):
    w = StoreWriter(tmp_path, run_id="r")
    rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=0.01)
    rid = rec.request_begin("req-1", tenant="acme", slo_class="batch", arrival_ns=5, trace_id="ab" * 16)
    rec.request_end(rid, finish_ns=9, error="")
    rec.span(rid, 3, 1, 2)  # token_index -1 etc.: nulls where the schema says so
    def from_journal() -> dict[str, pa.Table]:
        found = {t.name: read_journal(p, t)[0] for p in journals(w.run_path)
                 for t in (REQUESTS, SPANS) if p.parent.parent.name == t.name}
        return {name: data for name, data in found.items() if data is not None}

    deadline = time.monotonic() + 60
    while len(from_journal()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # waits for the flush thread to journal both tables
    journaled = from_journal()
    assert sorted(journaled) == [REQUESTS.name, SPANS.name]
    rec.close()
    run = open_run(tmp_path)
    for name, data in journaled.items():
        written = run.table(name)
        assert data.to_pylist() == written.to_pylist() and data.schema == written.schema
# --------------------------------------------------------------------------- killed processes


_VICTIM = textwrap.dedent(
    """
    import os, signal, sys, time
    from tokentrace.recorder import BufferedRecorder
    from tokentrace.schema import TABLES
    from tokentrace.store import StoreWriter
    from tokentrace.store.journal import read_journal

    store, fork = sys.argv[1], sys.argv[2] == "fork"
    w = StoreWriter(store, run_id="killed")
    rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=0.05)
    rec.instance(role=1, name="victim")
    for i in range(500):
        rec.span(i, 3, 10 * i, 10 * i + 5)
    rid = rec.request_begin("req-killed", tenant="acme", arrival_ns=1)
    rec.request_end(rid, finish_ns=2)

    def journaled():
        files = list(w.run_path.rglob("journal-*.arrows"))
        tables = [read_journal(f, TABLES[f.parent.parent.name])[0] for f in files]
        return sum(t.num_rows for t in tables if t is not None)

    while journaled() < 502:  # 500 spans, 1 request, 1 instance row: all handed to the journal
        time.sleep(0.01)  # polls the flush thread's progress; no work is being simulated
    if fork:
        child = os.fork()
        if child == 0:  # the child inherits the parent's descriptors; it must not keep its lock
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # nor the test's pipes
            os.dup2(devnull, 2)
            time.sleep(120)
            os._exit(0)
        print(child, flush=True)
    print("journaled", flush=True)
    time.sleep(120)  # killed long before this ends
    """
)


def _kill_after_journaling(store: Path, fork: bool) -> int | None:
    proc = subprocess.Popen([sys.executable, "-c", _VICTIM, str(store), "fork" if fork else "plain"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline()) if fork else None
        assert proc.stdout.readline().strip() == "journaled", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return child


@pytest.mark.parametrize("fork", [False, True])
def test_every_journaled_event_of_a_sigkilled_process_is_recovered(tmp_path, fork):
    child = _kill_after_journaling(tmp_path, fork)
    try:
        run_dir = tmp_path / "killed"
        assert run_dir.joinpath(SPANS.name).is_dir() and not list(run_dir.rglob("part-*.parquet"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run = open_run(tmp_path)  # recovers: the killed writer's lock is gone (and the child never held it)
            spans = run.table(SPANS.name)
            (request,) = run.table(REQUESTS.name).to_pylist()
        assert spans.column(col.REQUEST_ID).to_pylist() == list(range(500))
        assert request[col.REQUEST_KEY] == "req-killed" and request[col.TENANT] == "acme"
        assert {i["name"] for i in run.instances()} == {"victim"}  # (a forked child re-registers as itself)
        (writer,) = [w for w in run.manifest["writers"] if w["parent_writer"] is None]
        assert writer["ended_without_closing"] and not writer["closed"]
        assert writer["recovered_rows"] == {"instances": 1, "requests": 1, "spans": 500}
        (victim_id,) = set(spans.column(col.INSTANCE_ID).to_pylist())
        # The killed process's journals are gone; a forked child still alive may have journaled its own
        # instance row by now, under its own id and lock: that journal is live, not the victim's.
        assert [j for j in journals(run_dir) if f"instance={victim_id}" in j.parts] == []
        assert not (run_dir / JOURNAL_DIR / f"{writer['writer']}.lock").exists()
        assert open_run(tmp_path).num_rows(SPANS.name) == 500  # a second reader finds nothing left to do
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)


def test_a_recorder_without_a_journal_loses_what_it_had_not_flushed(tmp_path):
    """The counterpart: journal off (the flush alone), a SIGKILL loses every unflushed event."""
    code = textwrap.dedent(
        """
        import os, signal, sys
        from tokentrace.recorder import BufferedRecorder
        from tokentrace.store import StoreWriter
        w = StoreWriter(sys.argv[1], run_id="lost")
        rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=None)
        for i in range(100):
            rec.span(i, 3, i, i + 1)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=ENV, timeout=60)
    assert open_run(tmp_path).num_rows(SPANS.name) == 0 and journals(tmp_path / "lost") == []


# --------------------------------------------------------------------------- failures said, not raised


def test_a_journal_that_cannot_be_written_keeps_the_rows_for_their_part_and_says_why(tmp_path, monkeypatch):
    from tokentrace.store import journal as journal_module

    class FullDisk:  # the journal module's os, whose write finds no space
        def __getattr__(self, name: str):
            return getattr(os, name)

        @staticmethod
        def write(fd: int, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    w = StoreWriter(tmp_path, run_id="r")
    rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=0.01)
    monkeypatch.setattr(journal_module, "os", FullDisk())
    for i in range(4):
        rec.step(i, i, i + 1, 1, 0, 1, 0, 1, 0)
    deadline = time.monotonic() + 60
    while rec._flusher.journaled[STEPS.name] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)  # waits for the flush thread's (failing) journal append
    monkeypatch.undo()
    rec.close()  # the part still gets every row
    run = open_run(tmp_path)
    assert run.table(STEPS.name).column(col.STEP).to_pylist() == [0, 1, 2, 3]
    (writer,) = run.manifest["writers"]
    assert writer["errors"] == {"appending to the crash journal of steps": "OSError: [Errno 28] No space left on device"}
    assert rec.counters["sink_errors"] == 0


def test_a_part_that_cannot_be_written_is_counted_and_named_in_the_manifest(tmp_path, monkeypatch):
    from tokentrace.store import writer as writer_module

    w = StoreWriter(tmp_path, run_id="r")
    rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=0.05)
    for i in range(10):
        rec.span(i, 3, i, i + 1)

    def full(data, final):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "_write_parquet_atomically", full)
    rec.flush()
    assert rec.counters["sink_errors"] == 10 and rec.counters["buffered"] == 0
    monkeypatch.undo()
    rec.close()
    run = open_run(tmp_path)
    assert run.num_rows(SPANS.name) == 0 and journals(run.path) == []
    (writer,) = run.manifest["writers"]
    assert writer["errors"] == {"writing spans rows": "OSError: [Errno 28] No space left on device"}
    assert run.counters()["sink_errors"] == 10


def test_counters_add_up_while_rows_sit_in_the_journal(tmp_path):
    w = StoreWriter(tmp_path, run_id="r")
    rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=0.02)
    for i in range(50):
        rec.span(i, 3, i, i + 1)
    deadline = time.monotonic() + 60
    while rec._flusher.journaled[SPANS.name] < 50 and time.monotonic() < deadline:
        time.sleep(0.01)  # waits for the flush thread to journal them
    counters = rec.counters
    assert counters[SPANS.name] == 0 and counters["buffered"] == 50  # journaled, not yet in a part
    rec.close()
    assert rec.counters[SPANS.name] == 50 and rec.counters["buffered"] == 0
