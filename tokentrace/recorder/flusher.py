"""The recorder's background flush: drain buffers, build Arrow batches, write.

One daemon thread per recorder (the flush thread) writes every table holding at least
``batch_rows`` rows (full buffers) and, once ``flush_interval_s`` has passed since the
last complete flush, every row of every table (aged buffers). Without a journal it
checks for full buffers every ``poll_s`` (at most 50 ms); with one, the journal thread
checks at each of its passes (at least every 0.25 s) and wakes it when a table holds
that many, so no thread polls faster than the journal. Every part is cut and written under one lock, so
batches reach the sink in recording order per table and an explicit
:meth:`Flusher.flush_all` from another thread waits for a write in progress instead of
interleaving with it.

With a :class:`~tokentrace.recorder.sink.JournalSink` (the store writer) a second
daemon thread, the journal thread, hands every row over within
``journal_interval_s``: ``sink.journal`` appends it, as the buffer's raw int64 row
plus the strings its ids stand for, to a crash journal that survives the process.
The flush thread cuts a table's part from its journaled rows at the moments a plain
sink would (``batch_rows`` rows, ``flush_interval_s``): under the journal's own lock
it takes them and ``sink.seal`` closes their journal (later appends start the next
part's), then it converts them and calls ``sink.write`` without that lock, and the
write drops the sealed journal. The journal thread never waits for a part, however
slowly one is written, so a SIGKILLed process loses at most the last
``journal_interval_s`` of events (plus one pass), not the last ``flush_interval_s``,
for the cost of a copy and a small write per table per interval.

One table may lead (the recorder's ``instances``): whenever rows of another table go to the
sink (a journal append or a part), the lead table's pending rows go first. A process killed
in the middle of a hand-over then never leaves events in the store without the row that
names their process (its role, pid and clock anchor).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from typing import Callable

import pyarrow as pa

from tokentrace.recorder.buffers import StringDecoder, TableBuffer, to_record_batch
from tokentrace.recorder.sink import JournalSink, Sink
from tokentrace.schema import Table

__all__ = ["Flusher"]

log = logging.getLogger("tokentrace")

MAX_POLL_S = 0.05
"""Longest sleep between checks for full buffers without a journal (seconds)."""
MAX_FULL_CHECK_S = 0.25
"""With a journal: longest time between the journal thread's checks for full buffers (seconds)."""


def _empty_batch(table: Table) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=table.schema)


class Flusher:
    """Moves rows from a recorder's buffers to its sink.

    Counters here (rows written per table, rows lost to sink errors, rows left
    out as invalid at conversion) are only touched under ``lock``.
    """

    def __init__(
        self,
        sink: Sink,
        buffers: list[TableBuffer],
        *,
        instance_id: int,
        decoders: dict[str, StringDecoder],
        flush_interval_s: float,
        batch_rows: int,
        journal_interval_s: float | None = None,
        peekers: dict[str, StringDecoder] | None = None,
        on_full_flush: Callable[[], None] | None = None,
        lead_table: str | None = None,
    ) -> None:
        self.sink = sink
        # The lead table's buffer first, so every pass over the buffers hands its rows over first.
        self.buffers = sorted(buffers, key=lambda b: b.layout.table.name != lead_table)
        self._lead = self.buffers[0] if buffers and self.buffers[0].layout.table.name == lead_table else None
        self.instance_id = instance_id
        self.decoders = decoders
        self.peekers = peekers or {}  # like decoders, but leave the strings in place (journal)
        self.flush_interval_s = flush_interval_s
        self.batch_rows = batch_rows
        # Journal only into a sink that has one, and only if that is sooner than a full flush.
        journaling = (journal_interval_s is not None and journal_interval_s < flush_interval_s
                      and isinstance(sink, JournalSink))
        self.journal_sink: JournalSink | None = sink if journaling else None  # type: ignore[assignment]  # checked
        self.journal_interval_s = journal_interval_s if journaling else None
        self.on_full_flush = on_full_flush
        self.lock = threading.Lock()  # cutting and writing parts (flush thread, flush_all, close)
        self.journal_lock = threading.Lock()  # buffers -> journal -> pending rows (journal thread, a part's cut)
        self.written = {b.layout.table.name: 0 for b in buffers}
        self.journaled = {b.layout.table.name: 0 for b in buffers}  # handed to sink.journal, no part yet
        self._pending: dict[str, list[array]] = {b.layout.table.name: [] for b in buffers}  # their rows
        self.sink_errors = 0
        self.invalid = 0
        self._warned = False
        self._stop = threading.Event()
        self._full = threading.Event()  # journaling: a table holds batch_rows rows (wakes the flush thread)
        self._thread: threading.Thread | None = None
        self._journal_thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the daemon flush thread, and the journal thread when journaling (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokentrace-flush", daemon=True)
            self._thread.start()
            if self.journal_sink is not None:
                self._journal_thread = threading.Thread(target=self._run_journal, name="tokentrace-journal",
                                                        daemon=True)
                self._journal_thread.start()

    def stop(self) -> None:
        """Stop the threads and wait for them; does not flush (call flush_all)."""
        self._stop.set()
        self._full.set()
        for t in (self._thread, self._journal_thread):
            if t is not None and t is not threading.current_thread():
                t.join()

    @property
    def num_journaled(self) -> int:
        """Rows in the sink's journal, not yet written to a part (any thread)."""
        return sum(self.journaled.values())

    def _run(self) -> None:
        if self.journal_sink is not None:
            self._run_parts()
            return
        poll_s = min(self.flush_interval_s, MAX_POLL_S)
        last_full = time.monotonic()
        while not self._stop.wait(poll_s):
            now = time.monotonic()
            try:
                if now - last_full >= self.flush_interval_s:
                    last_full = now
                    self.flush_all()
                else:
                    self._flush_full_buffers()
            except Exception:  # never let the thread die: later events must still flush
                log.exception("tokentrace flush thread: unexpected error")

    def _run_parts(self) -> None:
        """The flush thread beside a journal thread: it sleeps until the next full flush, or until the
        journal thread finds a table with ``batch_rows`` rows (``_full``), and never polls."""
        last_full = time.monotonic()
        while not self._stop.is_set():
            self._full.wait(max(0.0, self.flush_interval_s - (time.monotonic() - last_full)))
            self._full.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() - last_full >= self.flush_interval_s:
                    last_full = time.monotonic()
                    self.flush_all()
                else:
                    self._flush_full_buffers()
            except Exception:  # never let the thread die: later events must still flush
                log.exception("tokentrace flush thread: unexpected error")

    def _run_journal(self) -> None:
        """The journal thread: every ``journal_interval_s``, every buffered row to the journal.

        It never waits for a part: a part is written by the flush thread outside ``journal_lock``,
        so a slow part write (a loaded machine, a slow disk) keeps no row out of the journal, not
        even its own table's. A table holding ``batch_rows`` rows wakes the flush thread.
        """
        interval = self.journal_interval_s
        assert interval is not None  # only started while journaling
        check_s = min(interval, MAX_FULL_CHECK_S)
        last = time.monotonic()
        while not self._stop.wait(max(0.0, min(check_s, last + interval - time.monotonic()))):
            try:
                if time.monotonic() - last >= interval:
                    last = time.monotonic()
                    self._journal_all()
                if any(b.num_rows() + self.journaled[b.layout.table.name] >= self.batch_rows for b in self.buffers):
                    self._full.set()
            except Exception:  # never let the thread die: later rows must still be journaled
                log.exception("tokentrace journal thread: unexpected error")

    def _flush_full_buffers(self) -> None:
        if self.journal_sink is not None:
            for b in self.buffers:
                if b.num_rows() + self.journaled[b.layout.table.name] >= self.batch_rows:
                    with self.lock:
                        self._commit(b)
            return
        with self.lock:
            for b in self.buffers:
                # Whole batches present now; later rows wait, so a producer
                # faster than the sink cannot starve the other tables.
                num_batches = b.num_rows() // self.batch_rows
                if num_batches:
                    self._hand_over_lead(b)
                for _ in range(num_batches):
                    self._write_one(b)

    def _hand_over_lead(self, b: TableBuffer) -> None:
        """Before rows of ``b`` go to the sink out of turn (a full buffer), the lead table's rows go:
        journaled (under ``journal_lock``), or written as a part without a journal (under ``lock``)."""
        lead = self._lead
        if lead is None or lead is b or not lead.num_rows():
            return
        if self.journal_sink is not None:
            self._journal(lead)
            return
        num_left = lead.num_rows()
        while num_left > 0 and self._write_one(lead):
            num_left -= self.batch_rows

    def _journal_all(self) -> None:
        """Hand every buffered row to the sink's crash journal (the flush thread cuts the parts).

        Each table's append is one ``write`` system call, which lets go of the GIL: a server's
        event loop waiting for this thread waits for one table's append at most.
        """
        for b in self.buffers:
            if not b.arr:
                continue
            with self.journal_lock:
                self._journal(b)

    def flush_all(self) -> None:
        """Write every row buffered when called (any thread; blocks while the sink writes).

        Rows recorded while this runs wait for the next flush, so a busy
        producer cannot keep one call going forever.
        """
        if self.journal_sink is not None:
            # Every row is in the journal before the first part is cut; the journal thread keeps
            # journaling while the parts are written, so a kill during a slow full flush loses no
            # more than a kill at any other moment.
            self._journal_all()
            for b in self.buffers:
                with self.lock:
                    self._commit(b)
        else:
            with self.lock:
                for b in self.buffers:
                    num_left = b.num_rows()
                    while num_left > 0 and self._write_one(b):
                        num_left -= self.batch_rows
        if self.on_full_flush is not None:
            self.on_full_flush()

    # ------------------------------------------------------------------ with a crash journal
    # Rows are journaled as they sit in the buffer (raw int64 rows plus the strings their ids
    # stand for), which costs a copy and a write; they become Arrow and Parquet only when a part
    # is cut. Their slots stay reserved until then, so the memory cap still holds them.

    def _journal(self, b: TableBuffer) -> None:
        """Move every row of ``b`` into the table's pending chunks and the sink's journal (under ``journal_lock``)."""
        chunk = b.take(len(b.arr))
        if chunk is None:
            return
        name = b.layout.table.name
        sink = self.journal_sink
        assert sink is not None  # only called while journaling
        try:
            sink.journal(b.layout.table, b.layout.fields, chunk, self._strings_of(b, chunk), self.instance_id)
        except Exception as e:  # the rows stay pending: only their crash protection is lost
            self.warn_once(f"journaling {name} rows", e)
        finally:
            self._pending[name].append(chunk)
            self.journaled[name] += len(chunk) // b.width

    def _strings_of(self, b: TableBuffer, chunk: array) -> dict[str, dict[int, str]]:
        """The strings the string columns' ids in ``chunk`` stand for (looked up, not consumed)."""
        out: dict[str, dict[int, str]] = {}
        for j, field in enumerate(b.layout.fields):
            peek = self.peekers.get(field)
            if peek is not None:
                ids = chunk[j::b.width]
                out[field] = dict(zip(ids, peek(ids)))
        return out

    def _commit(self, b: TableBuffer) -> None:
        """Write every row ``b``'s table holds as one part (under ``lock``).

        Under ``journal_lock`` the rest of the buffer is journaled, the pending rows are taken
        and the sink seals their journal (later appends go to the next part's); the part is then
        converted and written without ``journal_lock``, while the journal thread goes on.
        """
        name, table = b.layout.table.name, b.layout.table
        sink = self.journal_sink
        assert sink is not None  # only called while journaling
        with self.journal_lock:
            self._hand_over_lead(b)
            self._journal(b)
            chunks, self._pending[name] = self._pending[name], []
            num_rows, self.journaled[name] = self.journaled[name], 0
            if chunks:
                try:
                    sink.seal(table)
                except Exception as e:  # the write below fails the same way and counts the rows
                    self.warn_once(f"sealing the journal of {name} rows", e)
        if not chunks:
            return
        rows = chunks[0]
        for more in chunks[1:]:
            rows.extend(more)
        batch: pa.RecordBatch | None = None
        try:
            batch, num_invalid = to_record_batch(b.layout, rows, instance_id=self.instance_id,
                                                 decoders=self.decoders)
            self.invalid += num_invalid
        except Exception:
            self.invalid += num_rows
            log.exception("tokentrace: could not convert %d %s rows", num_rows, name)
        try:
            # Written even when empty (every row left out): the write releases the sealed journal.
            self.sink.write(table, batch if batch is not None else _empty_batch(table))
        except Exception as e:  # the sink's failure must not reach the server
            if batch is not None:
                self.sink_errors += batch.num_rows
            self.warn_once(f"writing {name} rows", e)
        else:
            if batch is not None:
                self.written[name] += batch.num_rows
        finally:
            b.done(num_rows)

    # ------------------------------------------------------------------ without one

    def _write_one(self, b: TableBuffer) -> bool:
        """Drain and write at most ``batch_rows`` rows of one table; False if none."""
        chunk = b.take(self.batch_rows)
        if chunk is None:
            return False
        num_rows = len(chunk) // b.width
        table = b.layout.table
        try:
            batch, num_invalid = to_record_batch(
                b.layout, chunk, instance_id=self.instance_id, decoders=self.decoders
            )
            self.invalid += num_invalid
            del chunk
            if batch.num_rows:
                try:
                    self.sink.write(table, batch)
                except Exception as e:  # the sink's failure must not reach the server
                    self.sink_errors += batch.num_rows
                    self.warn_once(f"writing {table.name} rows", e)
                else:
                    self.written[table.name] += batch.num_rows
        except Exception:
            # Conversion failed: a bug here, not bad input (that is filtered).
            self.invalid += num_rows
            log.exception("tokentrace: could not convert %d %s rows", num_rows, table.name)
        finally:
            b.done(num_rows)
        return True

    def warn_once(self, action: str, e: BaseException) -> None:
        """Log the first sink failure as a warning; later ones only count (any thread)."""
        if not self._warned:
            self._warned = True
            log.warning(
                "tokentrace: sink %s failed %s (%s: %s); rows it fails to write are dropped "
                "and counted in counters['sink_errors']; this warning is shown once",
                type(self.sink).__name__,
                action,
                type(e).__name__,
                e,
            )
