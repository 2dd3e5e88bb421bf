"""The flush thread hands a process's instance row to the sink before any event that row names.

A process killed in the middle of a hand-over (between the append of one table's journal and
the next, or right after a part) must not leave events in the store whose ``instances`` row,
its role, host, pid and clock anchor, is lost. Each case runs a real process that records its
instance row and then events, and SIGKILLs itself from inside the store writer right after
the first events reach the store (a journal append or a part); the next reader recovers what
it handed over, which must include the row naming them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokentrace.schema import INSTANCES, SPANS, Role, col
from tokentrace.store import open_run

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
NUM_SPANS = 50

_VICTIM = textwrap.dedent(
    """
    import os, signal, sys, time
    from tokentrace.recorder import BufferedRecorder
    from tokentrace.schema import INSTANCES, Role
    from tokentrace.store import StoreWriter

    class KilledAfterFirstEvents(StoreWriter):
        '''A real store writer whose process dies right after the first events reach the store.'''

        def journal(self, table, *args, **kwargs):
            super().journal(table, *args, **kwargs)
            self._may_die(table)

        def write(self, table, batch):
            super().write(table, batch)
            self._may_die(table)

        def _may_die(self, table):
            if table is not INSTANCES:
                os.kill(os.getpid(), signal.SIGKILL)

    store, journal_interval_s, batch_rows, num_spans = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    interval = None if journal_interval_s == "off" else float(journal_interval_s)
    w = KilledAfterFirstEvents(store, run_id="killed", journal=interval is not None)
    rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=interval,
                           batch_rows=batch_rows)
    rec.instance(role=Role.COLOCATED, name="victim")
    for i in range(num_spans):
        rec.span(i, 3, 10 * i, 10 * i + 5)
    time.sleep(60)  # the flush thread kills this process long before
    sys.exit(3)
    """
)


@pytest.mark.parametrize(
    ("journal_interval_s", "batch_rows"),
    [
        ("1.0", 65536),  # the periodic journal pass: the row and the events go in the same pass
        ("300", NUM_SPANS),  # a full events buffer is journaled and cut into a part between passes
        ("off", NUM_SPANS),  # no journal: a full events buffer is written as a part at once
    ],
    ids=["journal-pass", "full-buffer-journaled", "full-buffer-no-journal"],
)
def test_events_that_survive_a_sigkill_come_with_the_instance_row_naming_them(tmp_path, journal_interval_s,
                                                                             batch_rows):
    proc = subprocess.run([sys.executable, "-c", _VICTIM, str(tmp_path), journal_interval_s, str(batch_rows),
                           str(NUM_SPANS)], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr

    run = open_run(tmp_path, "killed")  # recovers the killed writer's journals, if any
    spans = run.table(SPANS.name)
    assert spans.column(col.REQUEST_ID).to_pylist() == list(range(NUM_SPANS))  # the first events survived
    (instance_id,) = set(spans.column(col.INSTANCE_ID).to_pylist())
    rows = run.table(INSTANCES.name).to_pylist()
    assert [(r[col.INSTANCE_ID], r[col.NAME], r[col.ROLE]) for r in rows] == [
        (instance_id, "victim", int(Role.COLOCATED))]
    (writer,) = run.manifest["writers"]
    assert writer["pid"] == rows[0][col.PID] and not writer["closed"]
