"""Where recorded batches go: the ``Sink`` protocol and an in-memory sink.

The recorder's flush thread turns its column buffers into Arrow record batches
and hands them to a sink. The Parquet store writer (``tokentrace.store``) is one
sink; :class:`InMemorySink` keeps batches in memory so tests (ours and users')
can assert on recorded events without touching disk.
"""

from __future__ import annotations

import threading
from array import array
from typing import Mapping, Protocol, Sequence, runtime_checkable

import pyarrow as pa

from tokentrace.schema import TABLES, Table


@runtime_checkable
class Sink(Protocol):
    """Receives record batches of one table at a time.

    Contract: ``write`` is called from the recorder's flush thread only (or from
    the thread calling ``Recorder.flush``/``close``), never from the hot path.
    It may block (disk I/O) and may raise; the recorder counts and logs a failed
    write as dropped rows and keeps going. ``close`` is called once, last.
    """

    def write(self, table: Table, batch: pa.RecordBatch) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class CounterSink(Sink, Protocol):
    """A sink that also keeps run-level counters (the store writer: into the manifest).

    ``update_counters`` replaces this writer's values of the named counters
    (events sampled out, dropped upstream of the recorder, ...). Any thread; may
    block briefly on a file write; never called from the hot path.
    """

    def update_counters(self, counters: Mapping[str, int]) -> None: ...


@runtime_checkable
class JournalSink(Sink, Protocol):
    """A sink that also keeps a crash journal of rows not yet written (the store writer).

    The flush thread hands it every buffered row within ``journal_interval_s``:
    ``journal(table, fields, rows, strings, instance_id)`` with ``rows`` the buffer's raw
    row-major int64 rows (``fields`` names their columns in order; ``instance_id`` fills
    the instance column) and ``strings`` the text each string column's ids stand for. It
    must be cheap (it runs several times a second) and survive the process being killed.
    Later ``seal(table)`` marks every row journaled so far as the next part's: appends after
    it belong to the part after that. The following ``write(table, batch)`` gets the sealed
    rows as one Arrow batch (a part; empty when every row was left out) and drops their
    journal. ``journal`` and ``seal`` may raise (the rows then only lose their crash
    protection). ``journal`` runs on the recorder's journal thread and ``seal``/``write`` on
    its flush thread, at the same time: a ``write`` in progress must not hold up ``journal``.
    """

    def journal(self, table: Table, fields: Sequence[str], rows: array, strings: Mapping[str, Mapping[int, str]],
                instance_id: int) -> None: ...

    def seal(self, table: Table) -> None: ...


class InMemorySink:
    """Keeps every batch in memory; ``table(name)`` returns them concatenated."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: dict[str, list[pa.RecordBatch]] = {name: [] for name in TABLES}
        self.closed = False

    def write(self, table: Table, batch: pa.RecordBatch) -> None:
        with self._lock:
            self._batches[table.name].append(batch)

    def close(self) -> None:
        self.closed = True

    def table(self, name: str) -> pa.Table:
        """All rows recorded so far for table ``name`` (schema from tokentrace.schema)."""
        t = TABLES[name] if name in TABLES else None
        if t is None:
            raise ValueError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
        with self._lock:
            batches = list(self._batches[name])
        return pa.Table.from_batches(batches, schema=t.schema)

    def num_rows(self, name: str) -> int:
        with self._lock:
            return sum(b.num_rows for b in self._batches[name])
