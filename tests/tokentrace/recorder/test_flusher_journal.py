"""The journal thread never waits for a part: rows recorded while a table's part is written slowly (a loaded
machine, a slow disk), that table's own rows included, reach the journal before the write ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tokentrace.recorder import BufferedRecorder, JournalSink
from tokentrace.schema import SPANS, TOKENS, col
from tokentrace.store import open_run

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


class SlowTokensSink:
    """A journal sink (in memory) whose ``tokens`` part is written only once ``release`` is set."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []  # (what, table, rows)
        self.writing_tokens = threading.Event()
        self.release = threading.Event()

    def journal(self, table, fields, rows, strings, instance_id) -> None:
        self.events.append(("journal", table.name, len(rows) // len(fields)))

    def seal(self, table) -> None:
        self.events.append(("seal", table.name, 0))

    def write(self, table, batch) -> None:
        if table is TOKENS and batch.num_rows:
            self.writing_tokens.set()
            self.release.wait(60)
        self.events.append(("write", table.name, batch.num_rows))

    def close(self) -> None:
        pass


def _wait_for(sink: SlowTokensSink, event: tuple[str, str, int], times: int) -> bool:
    deadline = time.monotonic() + 30
    while sink.events.count(event) < times and time.monotonic() < deadline:
        time.sleep(0.01)  # polls the journal thread's progress; no work is being simulated
    return sink.events.count(event) >= times


def test_rows_recorded_during_a_slow_part_are_journaled_while_it_is_written():
    sink = SlowTokensSink()
    assert isinstance(sink, JournalSink)
    rec = BufferedRecorder(sink, instance_id=1, flush_interval_s=600, journal_interval_s=0.02)
    try:
        rec.span(1, 3, 10, 20)
        rec.token(1, 0, emit_ns=20)
        flush = threading.Thread(target=rec.flush)
        flush.start()
        assert sink.writing_tokens.wait(30)
        rec.token(1, 1, emit_ns=30)  # the table whose part is being written
        rec.span(2, 3, 30, 40)
        journaled_during_write = (_wait_for(sink, ("journal", TOKENS.name, 1), 2)
                                  and _wait_for(sink, ("journal", SPANS.name, 1), 2))
        sink.release.set()
        flush.join(60)
        assert not flush.is_alive()
        assert journaled_during_write, sink.events
        # The first tokens part was sealed with its one row before the second row was journaled.
        tokens = [e for e in sink.events if e[1] == TOKENS.name]
        assert tokens[:4] == [("journal", TOKENS.name, 1), ("seal", TOKENS.name, 0), ("journal", TOKENS.name, 1),
                              ("write", TOKENS.name, 1)], sink.events
    finally:
        sink.release.set()
        rec.close()
    tokens = [e for e in sink.events if e[1] == TOKENS.name]
    assert tokens[4:] == [("seal", TOKENS.name, 0), ("write", TOKENS.name, 1)]  # the second token's part, at close
    assert rec.counters[TOKENS.name] == 2 and rec.counters[SPANS.name] == 2


_VICTIM = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from tokentrace.recorder import BufferedRecorder
    from tokentrace.store import StoreWriter
    from tokentrace.store import writer as writer_module

    written = writer_module._write_parquet_atomically
    stuck = threading.Event()

    def slow_tokens_part(data, final):  # the first tokens part never finishes: the disk hangs
        if final.parent.parent.name == "tokens":
            stuck.set()
            time.sleep(600)
        written(data, final)

    writer_module._write_parquet_atomically = slow_tokens_part
    w = StoreWriter(sys.argv[1], run_id="killed")
    rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=0.05)
    for i in range(100):
        rec.token(1, i, emit_ns=i)
    threading.Thread(target=rec.flush, daemon=True).start()
    assert stuck.wait(60)
    for i in range(100, 150):  # recorded while the tokens part is being written
        rec.token(1, i, emit_ns=i)
    rec.span(1, 3, 1, 2)
    second = Path(w.run_path, "tokens", f"instance={w.instance_id}", "journal-000002.arrows")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (second.exists() and rec._flusher.journaled["spans"]):
        time.sleep(0.01)  # polls the journal thread's progress; no work is being simulated
    print("journaled" if second.exists() else "not journaled", flush=True)
    time.sleep(600)  # killed long before this ends
    """
)


def test_rows_recorded_during_a_slow_part_survive_a_sigkill(tmp_path):
    """A real process whose tokens part hangs in the Parquet write is SIGKILLed: the reader recovers the rows
    the part held (its sealed journal) and those recorded during the write (the next part's journal)."""
    proc = subprocess.Popen([sys.executable, "-c", _VICTIM, str(tmp_path)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    assert line == "journaled", err
    run = open_run(tmp_path, "killed")
    assert sorted(run.table(TOKENS.name).column(col.TOKEN_INDEX).to_pylist()) == list(range(150))
    assert run.num_rows(SPANS.name) == 1
