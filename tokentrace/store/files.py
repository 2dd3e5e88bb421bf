"""Reading single part files: version checks, migration to the current schema, statistics.

A file written by an older tokentrace (schema version >=
``MIN_READABLE_SCHEMA_VERSION``) is brought to the current schema when read:
columns renamed since are mapped through :data:`MIGRATIONS`, columns added
since become nulls, columns dropped since are ignored, and types are cast. A
file that cannot be read (truncated, garbage, unreadable) is skipped with a
:class:`~tokentrace.store.manifest.CorruptFileWarning` naming it.
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
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    SPANS,
    Table,
    col,
)
from tokentrace.store.layout import StoreError
from tokentrace.store.manifest import CorruptFileWarning

__all__ = ["MIGRATIONS", "PartInfo", "renames_since", "part_info", "read_part", "column_min_max"]

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


def _warn_skip(path: Path, err: BaseException) -> None:
    warnings.warn(f"skipping unreadable store file {path}: {err}", CorruptFileWarning, stacklevel=4)


def part_info(path: Path) -> PartInfo | None:
    """Footer facts of one part file, or ``None`` (with a warning naming it) if unreadable.

    Raises ``StoreError`` for a schema version this tokentrace cannot read.
    """
    try:
        pf = pq.ParquetFile(path)
        version = _file_version(path, pf.schema_arrow)
        return PartInfo(path, version, pf.metadata.num_rows, path.stat().st_size)
    except (pa.ArrowException, OSError) as err:
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
        current_of = renames_since(version, table.name)
        file_name_of = {new: old for old, new in current_of.items()}
        present = set(pf.schema_arrow.names)
        to_read = [file_name_of.get(n, n) for n in wanted if file_name_of.get(n, n) in present]
        raw = pf.read(columns=to_read)
        return _conform(raw, target, file_name_of)
    except (pa.ArrowException, OSError) as err:
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
        file_name = {new: old for old, new in renames_since(version, table.name).items()}.get(name, name)
        if file_name not in pf.schema_arrow.names:
            return None
        bounds = _bounds_from_statistics(pf, file_name)
        if bounds is False:
            bounds = _bounds_from_data(pf.read(columns=[file_name]).column(0))
        return bounds
    except (pa.ArrowException, OSError) as err:
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
