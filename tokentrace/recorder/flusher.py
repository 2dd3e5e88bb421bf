"""The recorder's background flush: drain buffers, build Arrow batches, write.

One daemon thread per recorder wakes every ``poll_s`` (at most 50 ms). It
writes every table holding at least ``batch_rows`` rows (full buffers) and,
once ``flush_interval_s`` has passed since the last complete flush, every row
of every table (aged buffers). All draining and every ``sink.write`` happen
under one lock, so batches reach the sink in recording order per table and an
explicit :meth:`Flusher.flush_all` from another thread waits for a write in
progress instead of interleaving with it.

With a :class:`~tokentrace.recorder.sink.JournalSink` (the store writer) every row
is also handed over within ``journal_interval_s``: ``sink.journal`` appends it, as
the buffer's raw int64 row plus the strings its ids stand for, to a crash journal
that survives the process; ``sink.write`` gets the table's journaled rows as one
Arrow batch at the moments a plain sink would (``batch_rows`` rows,
``flush_interval_s``), and drops their journal. A SIGKILLed process thus loses at
most the last ``journal_interval_s`` of events, not the last ``flush_interval_s``,
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

from tokentrace.recorder.buffers import StringDecoder, TableBuffer, to_record_batch
from tokentrace.recorder.sink import JournalSink, Sink

__all__ = ["Flusher"]

log = logging.getLogger("tokentrace")

MAX_POLL_S = 0.05
"""Longest sleep between checks for full buffers (seconds)."""


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
        self.lock = threading.Lock()
        self.written = {b.layout.table.name: 0 for b in buffers}
        self.journaled = {b.layout.table.name: 0 for b in buffers}  # handed to sink.journal, no part yet
        self._pending: dict[str, list[array]] = {b.layout.table.name: [] for b in buffers}  # their rows
        self.sink_errors = 0
        self.invalid = 0
        self._warned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the daemon flush thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokentrace-flush", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it; does not flush (call flush_all)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    @property
    def num_journaled(self) -> int:
        """Rows in the sink's journal, not yet written to a part (any thread)."""
        return sum(self.journaled.values())

    def _run(self) -> None:
        poll_s = min(self.flush_interval_s, self.journal_interval_s or MAX_POLL_S, MAX_POLL_S)
        last_full = last_journal = time.monotonic()
        while not self._stop.wait(poll_s):
            now = time.monotonic()
            try:
                if now - last_full >= self.flush_interval_s:
                    last_full = last_journal = now
                    self.flush_all()
                elif self.journal_interval_s is not None and now - last_journal >= self.journal_interval_s:
                    last_journal = now
                    self._journal_all()
                else:
                    self._flush_full_buffers()
            except Exception:  # never let the thread die: later events must still flush
                log.exception("tokentrace flush thread: unexpected error")

    def _flush_full_buffers(self) -> None:
        with self.lock:
            for b in self.buffers:
                if self.journal_sink is not None:
                    if b.num_rows() + self.journaled[b.layout.table.name] >= self.batch_rows:
                        self._hand_over_lead(b)
                        self._journal(b)
                        self._commit(b)
                    continue
                # Whole batches present now; later rows wait, so a producer
                # faster than the sink cannot starve the other tables.
                num_batches = b.num_rows() // self.batch_rows
                if num_batches:
                    self._hand_over_lead(b)
                for _ in range(num_batches):
                    self._write_one(b)

    def _hand_over_lead(self, b: TableBuffer) -> None:
        """Before rows of ``b`` go to the sink out of turn (a full buffer), the lead table's rows go
        (under ``lock``): journaled, or written as a part without a journal."""
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
        """Hand every buffered row to the sink's crash journal (a part is cut once enough wait).

        Between two tables the thread lets go of the GIL (``time.sleep(0)``), so a server's
        event loop waiting for it waits for one table's append at most, not for all of them.
        """
        for b in self.buffers:
            if not b.num_rows():
                continue
            with self.lock:
                self._journal(b)
                if self.journaled[b.layout.table.name] >= self.batch_rows:
                    self._commit(b)
            time.sleep(0)

    def flush_all(self) -> None:
        """Write every row buffered when called (any thread; blocks while the sink writes).

        Rows recorded while this runs wait for the next flush, so a busy
        producer cannot keep one call going forever.
        """
        with self.lock:
            for b in self.buffers:
                if self.journal_sink is not None:
                    self._journal(b)
                    self._commit(b)
                    continue
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
        """Move every row of ``b`` into the table's pending chunks and the sink's journal (under ``lock``)."""
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
        """Write every row ``b``'s table has pending as one part (under ``lock``)."""
        name, table = b.layout.table.name, b.layout.table
        chunks, self._pending[name] = self._pending[name], []
        num_rows, self.journaled[name] = self.journaled[name], 0
        if not chunks:
            return
        rows = chunks[0]
        for more in chunks[1:]:
            rows.extend(more)
        try:
            batch, num_invalid = to_record_batch(b.layout, rows, instance_id=self.instance_id,
                                                 decoders=self.decoders)
            self.invalid += num_invalid
            if batch.num_rows:
                try:
                    self.sink.write(table, batch)
                except Exception as e:  # the sink's failure must not reach the server
                    self.sink_errors += batch.num_rows
                    self.warn_once(f"writing {name} rows", e)
                else:
                    self.written[name] += batch.num_rows
        except Exception:
            self.invalid += num_rows
            log.exception("tokentrace: could not convert %d %s rows", num_rows, name)
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
