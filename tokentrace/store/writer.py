"""``StoreWriter``: the sink that writes a run's record batches as Parquet files.

One writer per process. Each ``write`` becomes one zstd-compressed Parquet
file ``<store>/<run>/<table>/instance=<writer_id>/part-<n>.parquet``, written
under a temporary name and renamed into place, so a file is whole or absent
even if the process is killed mid-write. The schema (with the schema version
and table name in its metadata) is the table's ``Table.schema``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokentrace.schema import NULL_INT, TABLES, Role, Table, col
from tokentrace.store.layout import (
    new_instance_id,
    new_run_id,
    part_name,
    partition_dir,
    temp_path_for,
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

    Construction creates the run folder and manifest and may raise ``OSError``.
    """

    def __init__(
        self,
        store_path: str | os.PathLike[str],
        *,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
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
        self.run_path.mkdir(parents=True, exist_ok=True)
        write_run_manifest(self.run_path, self.run_id, self._config)
        self._fragment.save(self.run_path)

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

        Called from the recorder's flush thread; blocks for the file write.
        Raises ``ValueError`` if the batch's columns are not the table's,
        ``RuntimeError`` after ``close``, ``OSError`` on I/O failure (disk full,
        read-only file system): then no file appears and existing files are
        untouched. Integer columns the schema marks nullable have ``NULL_INT``
        (-1) turned into nulls.
        """
        data = prepare_batch(table, batch)
        if data.num_rows == 0:
            return
        with self._lock:
            if self._closed:
                raise RuntimeError(f"StoreWriter for run {self.run_id} is closed")
            number = self._next_part.get(table.name, 1)
            folder = partition_dir(self.run_path, table.name, self.instance_id)
            folder.mkdir(parents=True, exist_ok=True)
            _write_parquet_atomically(data, folder / part_name(number))
            self._next_part[table.name] = number + 1
            self._fragment.add_part(table.name, data.num_rows, _instance_ids(data))

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
        child = StoreWriter(self.store_path, run_id=self.run_id, config=self._config)
        child._fragment.parent_writer_id = self.instance_id
        child._fragment.save(child.run_path)
        return child

    def close(self) -> None:
        """Mark this writer closed and save its final manifest fragment; idempotent.

        Called once, last, by the recorder. May raise ``OSError`` if the
        fragment cannot be written; every part file written before stays valid.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fragment.closed = True
            self._fragment.save(self.run_path)


def prepare_batch(table: Table, batch: pa.RecordBatch | pa.Table) -> pa.Table:
    """``batch`` as a ``pa.Table`` with exactly ``table.schema`` (types and metadata).

    Raises ``ValueError`` if ``table`` is not a store table or the batch's
    column names differ from the table's (order included). Nullable integer
    columns have ``NULL_INT`` replaced by null; other columns are cast safely
    (``pa.ArrowInvalid`` on overflow).
    """
    if TABLES.get(table.name) != table:
        raise ValueError(f"unknown table {table.name!r}; tables: {', '.join(TABLES)}")
    names = list(batch.schema.names)
    if names != list(table.names):
        raise ValueError(
            f"batch columns for table {table.name} do not match the schema: got {names}, expected {list(table.names)}"
        )
    arrays = []
    for i, column in enumerate(table.columns):
        arr = batch.column(i)
        if column.nullable and pa.types.is_integer(arr.type):
            arr = _null_sentinels(arr)
        arrays.append(arr.cast(column.type) if arr.type != column.type else arr)
    return pa.Table.from_arrays(arrays, schema=table.schema)


def _instance_ids(data: pa.Table) -> list[int]:
    """Distinct non-null values of the rows' instance id column (for the manifest)."""
    if col.INSTANCE_ID not in data.column_names:
        return []
    return [v for v in pc.unique(data.column(col.INSTANCE_ID)).to_pylist() if v is not None]


def _null_sentinels(arr: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Replace ``NULL_INT`` by null in an integer array (a no-op copy-free path if none)."""
    mask = pc.equal(arr, pa.scalar(NULL_INT, arr.type))
    if not pc.any(mask).as_py():
        return arr
    return pc.if_else(mask, pa.scalar(None, arr.type), arr)


def _write_parquet_atomically(data: pa.Table, final: Path) -> None:
    """Write ``data`` to a temporary file next to ``final``, then rename it into place."""
    tmp = temp_path_for(final)
    try:
        pq.write_table(data, tmp, compression=_COMPRESSION)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
