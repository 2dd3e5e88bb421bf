"""A batch brought to its table's schema before it is written: column names checked, types
cast, and the recorder's ``NULL_INT`` sentinels turned into nulls (a part, and a recovered
crash journal)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tokentrace.schema import NULL_INT, TABLES, Table

__all__ = ["prepare_batch"]

_SCHEMAS = {name: t.schema for name, t in TABLES.items()}  # built once: Table.schema builds one per call


def prepare_batch(table: Table, batch: pa.RecordBatch | pa.Table) -> pa.Table:
    """``batch`` as a ``pa.Table`` with exactly ``table.schema`` (types and metadata).

    Raises ``ValueError`` if ``table`` is not a store table or the batch's
    column names differ from the table's (order included). Nullable integer
    columns have ``NULL_INT`` replaced by null; other columns are cast safely
    (``pa.ArrowInvalid`` on overflow).
    """
    known = TABLES.get(table.name)
    if known is not table and known != table:
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
    return pa.Table.from_arrays(arrays, schema=_SCHEMAS[table.name])


def _null_sentinels(arr: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Replace ``NULL_INT`` by null in an integer array (a no-op copy-free path if none)."""
    if not _may_hold(arr, NULL_INT):  # the usual case (the recorder's batches hold nulls already)
        return arr
    mask = pc.equal(arr, pa.scalar(NULL_INT, arr.type))
    if not pc.any(mask).as_py():
        return arr
    return pc.if_else(mask, pa.scalar(None, arr.type), arr)


def _may_hold(arr: pa.Array | pa.ChunkedArray, value: int) -> bool:
    """False only when no value of ``arr`` is ``value``: each chunk without nulls is compared as the
    numpy view of its buffer (no copy; a third of the two compute kernels' cost on a part's column),
    and a chunk with nulls answers True (the compute path decides)."""
    for chunk in arr.chunks if isinstance(arr, pa.ChunkedArray) else (arr,):
        if chunk.null_count or (chunk.to_numpy(zero_copy_only=True) == value).any():
            return True
    return False
