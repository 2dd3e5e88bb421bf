"""Reading single part files: version and schema checks, migration to the current schema, statistics.

A file written by an older tokentrace (schema version >=
``MIN_READABLE_SCHEMA_VERSION``) is brought to the current schema when read:
columns renamed since are mapped through :data:`MIGRATIONS`, columns added
since become nulls, columns dropped since are ignored, and types are cast. A
file that cannot be read (truncated, garbage, unreadable) is skipped with a
:class:`~tokentrace.store.manifest.CorruptFileWarning` naming it, and so is a
file whose schema is not its table's (:func:`schema_problem`): its metadata
names another table, it lacks one of the table's key columns, or a column has a
type that cannot hold the table's values (text in a time column).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokentrace.schema import (
    INSTANCES,
    MIN_READABLE_SCHEMA_VERSION,
    RUN_COLUMN,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    SPANS,
    TABLE_NAME_KEY,
    TABLES,
    Table,
    col,
)
from tokentrace.store.layout import StoreError
from tokentrace.store.manifest import CorruptFileWarning

__all__ = ["MIGRATIONS", "with_run_column", "PartInfo", "renames_since", "part_info", "read_part", "column_min_max", "schema_problem"]

MIGRATIONS: dict[int, dict[str, dict[str, str]]] = {
    # Version 0 (pre-release) -> 1: span bounds and the clock offset were renamed.
    # Version 0 also lacked spans.kv_tier/batch_num_seqs, tokens.recv_ns,
    # requests.otel_trace_id and instances.clock_rtt_ns; those read as nulls.
    0: {
        SPANS.name: {"t0_ns": col.START_NS, "t1_ns": col.END_NS},
        INSTANCES.name: {"offset_ns": col.CLOCK_OFFSET_NS},
    },
}
"""Column renames: ``{version v: {table: {name in v: name in v + 1}}}``.

A file of version ``v`` goes through the renames of ``v``, ``v + 1``, ...,
``SCHEMA_VERSION - 1`` in turn. Add an entry whenever a column is renamed and
bump ``SCHEMA_VERSION``; added columns need no entry (they read as nulls).
"""


def with_run_column(data: pa.Table, run_id: str) -> pa.Table:
    """``data`` with :data:`~tokentrace.schema.RUN_COLUMN` appended (``run_id`` in every row), as
    part files are written. Dictionary-encoded: one value per file costs a few bytes. The indices
    (all 0) are one zeroed buffer: a Python list of them cost ~40 ns a row on every part written."""
    indices = pa.Array.from_buffers(pa.int32(), data.num_rows, [None, pa.py_buffer(bytes(4 * data.num_rows))])
    values = pa.DictionaryArray.from_arrays(indices, pa.array([run_id]))
    return data.append_column(RUN_COLUMN.field().with_type(values.type), values)


@dataclass(frozen=True, slots=True)
class PartInfo:
    """What a part file's footer says."""

    path: Path
    schema_version: int
    num_rows: int
    num_bytes: int  # file size on disk


def renames_since(version: int, table_name: str) -> dict[str, str]:
    """``{name in a file of `version`: current name}`` for ``table_name`` (renamed columns only)."""
    mapping: dict[str, str] = {}  # name in the file -> name after the versions applied so far
    for v in range(version, SCHEMA_VERSION):
        step = MIGRATIONS.get(v, {}).get(table_name, {})
        renamed_before = set(mapping.values())
        # Names already renamed follow this step's rename too; others start here.
        mapping = {orig: step.get(cur, cur) for orig, cur in mapping.items()}
        for old, new in step.items():
            if old not in renamed_before:
                mapping[old] = new
    return mapping


def _file_version(path: Path, schema: pa.Schema) -> int:
    """The file's schema version; files without one are taken as current (e.g. rewritten by another tool)."""
    raw = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if raw is None:
        return SCHEMA_VERSION
    try:
        version = int(raw)
    except ValueError:
        raise StoreError(f"file {path} has an invalid schema version {raw!r}") from None
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"file {path} has schema version {version}, newer than this tokentrace reads "
            f"({SCHEMA_VERSION}); upgrade tokentrace"
        )
    if version < MIN_READABLE_SCHEMA_VERSION:
        raise StoreError(
            f"file {path} has schema version {version}, older than the oldest readable ({MIN_READABLE_SCHEMA_VERSION})"
        )
    return version


class _ForeignFile(ValueError):
    """The file's schema is not its table's; the message says how."""


def _warn_skip(path: Path, err: BaseException) -> None:
    if isinstance(err, _ForeignFile):
        warnings.warn(f"skipping store file {path}: {err}", CorruptFileWarning, stacklevel=4)
    else:
        warnings.warn(f"skipping unreadable store file {path}: {err}", CorruptFileWarning, stacklevel=4)


def _fits(file_type: pa.DataType, wanted: pa.DataType) -> bool:
    """Whether a file column of ``file_type`` can hold values of the table's ``wanted`` type."""
    if pa.types.is_null(file_type):
        return True
    if pa.types.is_dictionary(file_type):
        file_type = file_type.value_type
    if pa.types.is_integer(wanted):
        return pa.types.is_integer(file_type)
    if pa.types.is_string(wanted):
        return pa.types.is_string(file_type) or pa.types.is_large_string(file_type)
    return file_type == wanted


def schema_problem(schema: pa.Schema, table: Table, version: int) -> str | None:
    """Why a file of ``table`` with this Arrow ``schema`` (of schema ``version``) is not one, or None.

    Its metadata names another table; it lacks one of the table's non-nullable integer
    columns (ids, times: every version had them, under the names of that version); or
    a column's type cannot hold the table's values.
    """
    named = (schema.metadata or {}).get(TABLE_NAME_KEY)
    if named is not None and named.decode("utf-8", "replace") != table.name:
        return f"its metadata says it holds {named.decode('utf-8', 'replace')!r} rows, not {table.name!r} rows"
    file_name_of = {new: old for old, new in renames_since(version, table.name).items()}
    present = {f.name: f.type for f in schema}
    missing = [c.name for c in table.columns if not c.nullable and pa.types.is_integer(c.type)
               and file_name_of.get(c.name, c.name) not in present]
    if missing:
        return f"it is not a {table.name} file: it lacks the column(s) {', '.join(missing)}"
    for c in table.columns:
        file_type = present.get(file_name_of.get(c.name, c.name))
        if file_type is not None and not _fits(file_type, c.type):
            return f"its column {c.name} is of type {file_type}, which cannot hold {table.name}.{c.name} ({c.type})"
    return None


def _check_schema(path: Path, schema: pa.Schema, table: Table | None, version: int) -> None:
    if table is not None:
        problem = schema_problem(schema, table, version)
        if problem is not None:
            raise _ForeignFile(problem)


_INT_RANGE = {pa.int8(): (-(2**7), 2**7 - 1), pa.int32(): (-(2**31), 2**31 - 1), pa.int64(): (-(2**63), 2**63 - 1)}


def _narrower(file_type: pa.DataType, wanted: pa.DataType) -> bool:
    """Whether an integer column of ``file_type`` may hold values ``wanted`` cannot."""
    if pa.types.is_dictionary(file_type):
        file_type = file_type.value_type
    if not (pa.types.is_integer(file_type) and wanted in _INT_RANGE):
        return False
    if pa.types.is_unsigned_integer(file_type):
        return file_type.bit_width >= wanted.bit_width
    return file_type.bit_width > wanted.bit_width


def _check_ranges(pf: pq.ParquetFile, table: Table | None, version: int) -> None:
    """For integer columns wider than the table's (a file rewritten by another tool), the values
    must fit: a reader casts them (DuckDB refuses the whole query on one that does not)."""
    if table is None:
        return
    file_name_of = {new: old for old, new in renames_since(version, table.name).items()}
    types = {f.name: f.type for f in pf.schema_arrow}
    for c in table.columns:
        name = file_name_of.get(c.name, c.name)
        if name not in types or not _narrower(types[name], c.type):
            continue
        bounds = _bounds_from_statistics(pf, name)
        if bounds is False:
            bounds = _bounds_from_data(pf.read(columns=[name]).column(0))
        lo, hi = _INT_RANGE[c.type]
        if bounds is not None and (bounds[0] < lo or bounds[1] > hi):
            raise _ForeignFile(f"its column {c.name} ({types[name]}) holds values from {bounds[0]} to {bounds[1]}, "
                               f"beyond what {table.name}.{c.name} ({c.type}) holds")


def _table_of(path: Path) -> Table | None:
    """The table a part file belongs to, from its folder (``<table>/instance=<id>/part-<n>.parquet``)."""
    return TABLES.get(path.parent.parent.name)


def part_info(path: Path) -> PartInfo | None:
    """Footer facts of one part file, or ``None`` (with a warning naming it) if unreadable.

    Unreadable also means a schema that is not its table's (the table is the file's
    folder). Raises ``StoreError`` for a schema version this tokentrace cannot read.
    """
    try:
        pf = pq.ParquetFile(path)
        version = _file_version(path, pf.schema_arrow)
        _check_schema(path, pf.schema_arrow, _table_of(path), version)
        _check_ranges(pf, _table_of(path), version)
        return PartInfo(path, version, pf.metadata.num_rows, path.stat().st_size)
    except (pa.ArrowException, OSError, _ForeignFile) as err:
        _warn_skip(path, err)
        return None


def read_part(path: Path, table: Table, columns: Sequence[str] | None = None) -> pa.Table | None:
    """One part file as a table with the current schema of ``table`` (or its ``columns``).

    Returns ``None`` with a warning naming the file if it is truncated,
    corrupt or cannot be cast; raises ``StoreError`` for an unreadable version.
    """
    wanted = list(table.names if columns is None else columns)
    target = pa.schema([table.schema.field(n) for n in wanted], metadata=table.schema.metadata)
    try:
        pf = pq.ParquetFile(path)
        version = _file_version(path, pf.schema_arrow)
        _check_schema(path, pf.schema_arrow, table, version)
        current_of = renames_since(version, table.name)
        file_name_of = {new: old for old, new in current_of.items()}
        present = set(pf.schema_arrow.names)
        to_read = [file_name_of.get(n, n) for n in wanted if file_name_of.get(n, n) in present]
        raw = pf.read(columns=to_read)
        return _conform(raw, target, file_name_of)
    except (pa.ArrowException, OSError, _ForeignFile) as err:
        _warn_skip(path, err)
        return None


def _conform(raw: pa.Table, target: pa.Schema, file_name_of: dict[str, str]) -> pa.Table:
    """Arrange ``raw`` (file column names) as ``target``: map renames, fill nulls, cast."""
    arrays = []
    for field in target:
        source = file_name_of.get(field.name, field.name)
        if source in raw.column_names:
            arr = raw.column(source)
            arrays.append(arr.cast(field.type) if arr.type != field.type else arr)
        else:
            arrays.append(pa.nulls(raw.num_rows, field.type))
    return pa.Table.from_arrays(arrays, schema=target)


def column_min_max(path: Path, table: Table, name: str) -> tuple[int, int] | None:
    """(min, max) of integer column ``name`` in one file, from Parquet statistics when present.

    ``None`` if the column is absent or all null, or the file is unreadable
    (warned). Falls back to reading the column when a row group lacks statistics.
    """
    try:
        pf = pq.ParquetFile(path)
        version = _file_version(path, pf.schema_arrow)
        _check_schema(path, pf.schema_arrow, table, version)
        file_name = {new: old for old, new in renames_since(version, table.name).items()}.get(name, name)
        if file_name not in pf.schema_arrow.names:
            return None
        bounds = _bounds_from_statistics(pf, file_name)
        if bounds is False:
            bounds = _bounds_from_data(pf.read(columns=[file_name]).column(0))
        return bounds
    except (pa.ArrowException, OSError, _ForeignFile) as err:
        _warn_skip(path, err)
        return None


def _bounds_from_statistics(pf: pq.ParquetFile, file_name: str) -> tuple[int, int] | None | bool:
    """Bounds from row-group statistics; ``False`` if some row group has none usable."""
    lo: int | None = None
    hi: int | None = None
    meta = pf.metadata
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        chunk = next((rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema == file_name), None)
        stats = chunk.statistics if chunk is not None else None
        if stats is None:
            return False
        if not stats.has_min_max:
            if stats.null_count == rg.num_rows:
                continue  # all null: nothing to bound
            return False
        lo = stats.min if lo is None else min(lo, stats.min)
        hi = stats.max if hi is None else max(hi, stats.max)
    return None if lo is None or hi is None else (int(lo), int(hi))


def _bounds_from_data(arr: pa.ChunkedArray) -> tuple[int, int] | None:
    result = pc.min_max(arr)
    lo, hi = result["min"].as_py(), result["max"].as_py()
    return None if lo is None or hi is None else (int(lo), int(hi))
