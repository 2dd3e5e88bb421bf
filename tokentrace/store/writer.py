"""``StoreWriter``: the sink that writes a run's record batches as Parquet files.

One writer per process. Each ``write`` becomes one zstd-compressed Parquet
file ``<store>/<run>/<table>/instance=<writer_id>/part-<n>.parquet``, written
under a temporary name and renamed into place, so a file is whole or absent
even if the process is killed mid-write. The schema (with the schema version
and table name in its metadata) is the table's ``Table.schema``.

The recorder's journal thread also calls ``journal`` several times a second: the rows it
still holds for a table's next part are appended, raw, to that part's crash journal
(:mod:`tokentrace.store.journal`). ``seal`` closes that journal when the recorder cuts the
part (later rows start the next part's journal), and the ``write`` of the part, done
without the writer's lock so appends go on meanwhile, deletes the sealed journal.
Parts keep their fixed cost (one per table every few seconds) while a killed process
loses only the rows not yet journaled.
"""

from __future__ import annotations

import os
import threading
from array import array
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokentrace.schema import Role, Table, col
from tokentrace.store.batches import prepare_batch
from tokentrace.store.files import with_run_column
from tokentrace.store.journal import TableJournal, WriterLock, encode_rows
from tokentrace.store.layout import (
    atomic_write,
    new_instance_id,
    new_run_id,
    part_name,
    partition_dir,
    validate_run_id,
)
from tokentrace.store.manifest import WriterFragment, check_config, write_run_manifest

__all__ = ["StoreWriter", "prepare_batch"]

_COMPRESSION = "zstd"


class StoreWriter:
    """Writes one process's share of a run to a store folder; implements ``Sink``.

    ``run_id`` defaults to a fresh sortable id (``20261129T101500Z-1a2b3c``);
    a given one must use only letters, digits, ``.``, ``_`` and ``-``
    (``ValueError`` otherwise). ``config`` (a JSON-serializable mapping) goes
    into the run manifest if this writer creates the run. Several writers, in
    several processes, may write the same run at once: each has its own
    ``instance_id`` (random positive 63-bit int), its own partition folders and
    its own manifest fragment, so they never touch the same file.
    ``journal=False`` turns the crash journal off (:meth:`journal` does nothing).

    Construction creates the run folder and manifest and may raise ``OSError``.
    """

    def __init__(
        self,
        store_path: str | os.PathLike[str],
        *,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        journal: bool = True,
    ) -> None:
        self.store_path = Path(store_path)
        self.run_id = new_run_id() if run_id is None else validate_run_id(run_id)
        self.run_path = self.store_path / self.run_id
        self.instance_id = new_instance_id()
        self._config = check_config(config)
        self._lock = threading.Lock()
        self._next_part: dict[str, int] = {}  # table name -> next part number (1-based)
        self._closed = False
        self._fragment = WriterFragment(self.instance_id, config=self._config)
        self._journals: dict[str, TableJournal] = {}  # the open journal of each table's next part
        self._sealed: dict[str, tuple[int, TableJournal | None]] = {}  # sealed: (part number, its journal)
        self._writer_lock: WriterLock | None = None
        self._journal_state = "off" if not journal else "unset"  # unset -> on | failed
        self.run_path.mkdir(parents=True, exist_ok=True)
        write_run_manifest(self.run_path, self.run_id, self._config)
        self._fragment.save(self.run_path)
        if journal:
            self._journal_on()  # the lock now, at set-up, not in the first journal append under load

    def __repr__(self) -> str:
        return f"StoreWriter({str(self.store_path)!r}, run_id={self.run_id!r}, instance_id={self.instance_id})"

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, table: Table, batch: pa.RecordBatch | pa.Table) -> None:
        """Write ``batch`` (rows of ``table``) as one new part file; empty batches write nothing.

        After :meth:`seal` the part takes the sealed journal's number and the sealed journal
        is deleted once the part is written (or given up with it when the write fails);
        without one, the table's open journal is. The Parquet file is written without the
        writer's lock, so :meth:`journal` appends meanwhile (the recorder's journal thread)
        never wait for it. Called from the recorder's flush thread; blocks for the file write.
        Raises ``ValueError`` if the batch's columns are not the table's,
        ``RuntimeError`` after ``close``, ``OSError`` on I/O failure (disk full,
        read-only file system): then no file appears and existing files are
        untouched. Integer columns the schema marks nullable have ``NULL_INT``
        (-1) turned into nulls.
        """
        data = prepare_batch(table, batch)
        with self._lock:
            self._check_open()
            sealed = self._sealed.pop(table.name, None)
            if sealed is None:
                number = self._take_part_number(table) if data.num_rows else 0
                journal = self._journals.pop(table.name, None)
            else:
                number, journal = sealed
        try:
            if data.num_rows:
                self._write_part(table, data, number)
        finally:
            if journal is not None:
                journal.discard()  # its rows are in the part now, or given up with it

    def seal(self, table: Table) -> None:
        """The rows journaled for ``table`` so far are those of its next :meth:`write`: that write
        takes the next part number and deletes their journal, and later :meth:`journal` appends
        go to the journal of the part after it. ``RuntimeError`` after ``close``."""
        with self._lock:
            self._check_open()
            previous = self._sealed.pop(table.name, None)
            if previous is not None:  # sealed and never written: its rows went with the write that failed
                if previous[1] is not None:
                    previous[1].discard()
            self._sealed[table.name] = (self._take_part_number(table), self._journals.pop(table.name, None))

    def _take_part_number(self, table: Table) -> int:
        """The next part number of ``table``, reserved (under the lock)."""
        number = self._next_part.get(table.name, 1)
        self._next_part[table.name] = number + 1
        return number

    def journal(self, table: Table, fields: Sequence[str], rows: array, strings: Mapping[str, Mapping[int, str]],
                instance_id: int) -> None:
        """Append rows the recorder holds for ``table``'s next part to that part's crash journal.

        ``rows``: row-major int64 rows whose columns are ``fields``, in order (the table's
        columns but ``instance_id``, which is ``instance_id``); ``strings``: for each string
        column, the text of the ids its rows hold. The next :meth:`write` of the table gets
        the same rows and deletes the journal (see :meth:`seal`). Called from the recorder's
        journal thread, several times a second: one small ``write`` system call. A journal that cannot be
        appended to (disk full) does not raise: the table's journal stops until its next
        part and the failure is noted in the manifest fragment (the rows themselves are
        not lost unless the process dies too). ``RuntimeError`` after ``close``.
        """
        if not rows:
            return
        with self._lock:
            self._check_open()
            if not self._journal_on():
                return
            journal = self._journals.get(table.name)
            if journal is None:
                folder = partition_dir(self.run_path, table.name, self.instance_id)
                journal = self._journals[table.name] = TableJournal(folder, self._next_part.get(table.name, 1))
            if journal.broken:
                return
            try:
                journal.append(encode_rows(fields, rows, strings, instance_id))
            except OSError as err:
                self._note_error(f"appending to the crash journal of {table.name}", err)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"StoreWriter for run {self.run_id} is closed")

    def _journal_on(self) -> bool:
        if self._journal_state == "unset":
            try:
                self._writer_lock = WriterLock(self.run_path, self.instance_id)
                self._journal_state = "on"
            except OSError as err:
                self._journal_state = "failed"
                self._note_error("creating the crash journal's lock file", err)
        return self._journal_state == "on"

    def _write_part(self, table: Table, data: pa.Table, number: int) -> None:
        """Write part ``number`` (without the lock: the number is reserved), then note it in the fragment."""
        folder = partition_dir(self.run_path, table.name, self.instance_id)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _write_parquet_atomically(with_run_column(data, self.run_id), folder / part_name(number))
        except OSError as err:  # the caller (the recorder) counts the rows and warns once
            with self._lock:
                self._note_error(f"writing {table.name} rows", err)
            raise
        with self._lock:
            self._fragment.add_part(table.name, data.num_rows, _instance_ids(data))

    def _note_error(self, action: str, err: BaseException) -> None:
        """Keep the first failure of each kind in the manifest fragment, so the run says why
        rows are missing or unprotected (best effort: the fragment may not be writable either)."""
        if not self._fragment.note_error(action, err):
            return
        try:
            self._fragment.save(self.run_path)
        except OSError:
            pass

    def register_instance(self, instance_id: int, role: Role | str | int, name: str) -> None:
        """Record in the manifest that this process traces ``instance_id`` with ``role``/``name``.

        Any thread, never the hot path: rewrites this writer's manifest
        fragment (a small file). Raises ``ValueError`` for a bad id or role,
        ``OSError`` if the fragment cannot be written.
        """
        with self._lock:
            self._fragment.register_instance(instance_id, role, name)
            self._fragment.save(self.run_path)

    def update_counters(self, counters: Mapping[str, int]) -> None:
        """Store this process's cumulative counters (``dropped``, ``sampled_out``, ...).

        Values are totals since the process started and replace earlier values
        of the same keys; readers sum them over processes. Any thread, never
        the hot path (rewrites a small file). Raises ``ValueError`` for
        non-integer values, ``OSError`` if the fragment cannot be written.
        """
        with self._lock:
            self._fragment.update_counters(counters)
            self._fragment.save(self.run_path)

    def fork_child(self) -> StoreWriter:
        """A writer for the same run with a fresh ``instance_id``, for a forked child.

        Call in the child right after ``fork()``. It does not touch this
        writer's lock, which another thread of the parent may have held at the
        moment of the fork.
        """
        # The parent's descriptors stay the parent's: close our copies, never write through them.
        for journal in self._journals.values():
            journal.forget_in_child()
        for _, sealed in self._sealed.values():
            if sealed is not None:
                sealed.forget_in_child()
        self._journals = {}
        self._sealed = {}
        if self._writer_lock is not None:
            self._writer_lock.forget_in_child()
            self._writer_lock = None
            self._journal_state = "unset"  # taken afresh if this object is ever used again
        child = StoreWriter(self.store_path, run_id=self.run_id, config=self._config,
                            journal=self._journal_state != "off")
        child._fragment.parent_writer_id = self.instance_id
        child._fragment.save(child.run_path)
        return child

    def close(self) -> None:
        """Mark this writer closed and save its final manifest fragment; idempotent.

        Called once, last, by the recorder (after it wrote everything it journaled).
        A journal still open (rows journaled and never written) is left for the next
        reader to recover. May raise ``OSError`` if the fragment cannot be written;
        every part file written before stays valid.
        """
        with self._lock:
            if self._closed:
                return
            for journal in self._journals.values():
                journal.close()
            for _, sealed in self._sealed.values():
                if sealed is not None:
                    sealed.close()
            self._journals = {}
            self._sealed = {}
            self._closed = True
            if self._writer_lock is not None:
                self._writer_lock.release(remove=True)
                self._writer_lock = None
            self._fragment.closed = True
            self._fragment.save(self.run_path)


def _instance_ids(data: pa.Table) -> list[int]:
    """Distinct non-null values of the rows' instance id column (for the manifest)."""
    if col.INSTANCE_ID not in data.column_names:
        return []
    return [v for v in pc.unique(data.column(col.INSTANCE_ID)).to_pylist() if v is not None]


def _write_parquet_atomically(data: pa.Table, final: Path) -> None:
    """Write ``data`` to a temporary file next to ``final``, then rename it into place."""
    atomic_write(final, lambda tmp: pq.write_table(data, tmp, compression=_COMPRESSION))
