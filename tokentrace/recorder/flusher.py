"""The recorder's background flush: drain buffers, build Arrow batches, write.

One daemon thread per recorder wakes every ``poll_s`` (at most 50 ms). It
writes every table holding at least ``batch_rows`` rows (full buffers) and,
once ``flush_interval_s`` has passed since the last complete flush, every row
of every table (aged buffers). All draining and every ``sink.write`` happen
under one lock, so batches reach the sink in recording order per table and an
explicit :meth:`Flusher.flush_all` from another thread waits for a write in
progress instead of interleaving with it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from tokentrace.recorder.buffers import StringDecoder, TableBuffer, to_record_batch
from tokentrace.recorder.sink import Sink

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
        on_full_flush: Callable[[], None] | None = None,
    ) -> None:
        self.sink = sink
        self.buffers = buffers
        self.instance_id = instance_id
        self.decoders = decoders
        self.flush_interval_s = flush_interval_s
        self.batch_rows = batch_rows
        self.on_full_flush = on_full_flush
        self.lock = threading.Lock()
        self.written = {b.layout.table.name: 0 for b in buffers}
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

    def _run(self) -> None:
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

    def _flush_full_buffers(self) -> None:
        with self.lock:
            for b in self.buffers:
                # Whole batches present now; later rows wait, so a producer
                # faster than the sink cannot starve the other tables.
                num_batches = b.num_rows() // self.batch_rows
                for _ in range(num_batches):
                    self._write_one(b)

    def flush_all(self) -> None:
        """Write every row buffered when called (any thread; blocks while the sink writes).

        Rows recorded while this runs wait for the next flush, so a busy
        producer cannot keep one call going forever.
        """
        with self.lock:
            for b in self.buffers:
                num_left = b.num_rows()
                while num_left > 0 and self._write_one(b):
                    num_left -= self.batch_rows
        if self.on_full_flush is not None:
            self.on_full_flush()

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
