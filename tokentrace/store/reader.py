"""Reading a store: find its runs, open one as a :class:`Run`, read its tables.

Everything here reads only finished files (``part-<n>.parquet``); temporary
files of writers still at work are never opened. A truncated or corrupt file,
or one whose schema is not its table's, is skipped with a
:class:`~tokentrace.store.manifest.CorruptFileWarning` naming it.

Opening a run (:func:`open_run`, :func:`list_runs`) first recovers the crash
journals of writers that were killed (:func:`tokentrace.store.journal.recover_run`),
and checks the run's manifest: a run written by a newer tokentrace (a schema
version this one does not know) is refused.
Bad input (missing path, not a store, empty store, unknown run, unknown table
or column) raises :class:`~tokentrace.store.layout.StoreError` (a
``ValueError``) with one sentence saying what is wrong.
"""

from __future__ import annotations

import datetime as dt
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from tokentrace.schema import REQUESTS, SPANS, TABLES, Table, col
from tokentrace.store.derived import parts_fingerprint
from tokentrace.store.files import column_min_max, part_info, read_part
from tokentrace.store.journal import recover_run
from tokentrace.store.layout import MANIFEST_NAME, StoreError, is_temp_name, part_files
from tokentrace.store.manifest import (
    DROPPED,
    SAMPLED_OUT,
    CorruptFileWarning,
    manifest_problem,
    read_fragments,
    read_manifest,
)

__all__ = ["Run", "RunInfo", "TableInfo", "open_run", "list_runs", "find_run_dirs"]

_MAX_LISTED = 10  # run ids named in an "unknown run" error
_PANDAS_INTS = {
    pa.int8(): pd.Int8Dtype(),
    pa.int16(): pd.Int16Dtype(),
    pa.int32(): pd.Int32Dtype(),
    pa.int64(): pd.Int64Dtype(),
}

# Columns whose minimum / maximum bound a run's time span (recording clocks, ns).
_SPAN_STARTS = ((SPANS, col.START_NS), (REQUESTS, col.ARRIVAL_NS))
_SPAN_ENDS = ((SPANS, col.END_NS), (REQUESTS, col.FINISH_NS))


@dataclass(frozen=True, slots=True)
class TableInfo:
    """Size of one table of a run (unreadable files left out)."""

    name: str
    num_rows: int
    num_files: int
    num_bytes: int  # on disk, compressed


@dataclass(frozen=True, slots=True)
class RunInfo:
    """Summary of one run, as listed by :func:`list_runs`."""

    run_id: str
    path: Path
    created: str | None  # ISO 8601 UTC from the manifest; None if it has none
    tables: dict[str, int]  # table name -> rows, for tables with at least one file
    time_span_ns: tuple[int, int] | None  # (first, last) recorded time, raw recording clocks
    counters: dict[str, int]  # summed over writing processes

    @property
    def duration_ns(self) -> int:
        return 0 if self.time_span_ns is None else self.time_span_ns[1] - self.time_span_ns[0]

    @property
    def num_dropped(self) -> int:
        return self.counters.get(DROPPED, 0)

    @property
    def num_sampled_out(self) -> int:
        return self.counters.get(SAMPLED_OUT, 0)


class Run:
    """One run of a store, opened for reading. Not tied to a thread; holds no open files.

    The manifest and the file list are read afresh by each call, so a ``Run``
    opened while writers are still at work sees their newer files.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.run_id = self.path.name

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @property
    def manifest(self) -> dict[str, Any]:
        """The merged manifest (run-level file plus every writer's fragment)."""
        return read_manifest(self.path)

    @property
    def created(self) -> str | None:
        created = self.manifest.get("created")
        return created if isinstance(created, str) else None

    def tables(self) -> list[str]:
        """Names of the tables with at least one finished file, in schema order."""
        return [name for name in TABLES if part_files(self.path / name)]

    def files(self, name: str) -> list[Path]:
        """Finished part files of table ``name``, ordered by (partition, part number)."""
        return part_files(self.path / _table_def(name).name)

    def fingerprint(self) -> str:
        """A digest of every finished part file of every table (path, size, modification time): it changes when
        a part is added, removed, rewritten or recovered. The run's data version: derived facts are stamped with
        it, caches of results are keyed by it. One ``stat`` per part."""
        return parts_fingerprint(self.path)

    def is_finished(self) -> bool:
        """True when every process that wrote the run closed its writer (no part will follow)."""
        fragments = read_fragments(self.path)
        return bool(fragments) and all(f.get("closed") is True for f in fragments)

    def table(
        self,
        name: str,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
    ) -> pa.Table:
        """All rows of table ``name`` over every writer's partition, in the current schema.

        ``columns`` selects and orders columns; ``filter`` is a pyarrow compute
        expression (``pc.field(col.STAGE) == 6``). Files of older schema
        versions are migrated (missing columns are nulls); unreadable files are
        skipped with a warning naming them. A table with no files reads as an
        empty table. ``StoreError`` for an unknown table or column or a bad filter.
        """
        t = _table_def(name)
        wanted = _check_columns(t, columns)
        if filter is not None and not isinstance(filter, pc.Expression):
            raise StoreError(f"filter must be a pyarrow.compute.Expression, got {type(filter).__name__}")
        read_columns = wanted if filter is None else None  # a filter may use any column
        parts = []
        for f in self.files(name):
            part = read_part(f, t, read_columns)
            if part is None:
                continue
            if filter is not None:  # per file, so memory peaks at one unfiltered file
                part = _apply_filter(part, filter, t)
                part = part if wanted is None else part.select(wanted)
            parts.append(part)
        if parts:
            return pa.concat_tables(parts)
        if filter is not None:
            _apply_filter(t.schema.empty_table(), filter, t)  # a bad filter fails even with no rows
        names = t.names if wanted is None else wanted
        return pa.schema([t.schema.field(n) for n in names], metadata=t.schema.metadata).empty_table()

    def to_pandas(
        self, name: str, columns: Sequence[str] | None = None, filter: pc.Expression | None = None
    ) -> pd.DataFrame:
        """:meth:`table` as a pandas DataFrame; integer columns use pandas' nullable
        ``Int8``/``Int32``/``Int64`` dtypes, so nanosecond times stay exact (no float64)."""
        return self.table(name, columns=columns, filter=filter).to_pandas(types_mapper=_PANDAS_INTS.get)

    def num_rows(self, name: str) -> int:
        """Rows of table ``name`` from the file footers (no data read)."""
        return self.table_info(name).num_rows

    def table_info(self, name: str) -> TableInfo:
        """Rows, files and bytes of table ``name`` (unreadable files skipped, warned)."""
        infos = [i for i in (part_info(f) for f in self.files(name)) if i is not None]
        return TableInfo(name, sum(i.num_rows for i in infos), len(infos), sum(i.num_bytes for i in infos))

    def time_span_ns(self) -> tuple[int, int] | None:
        """(earliest start, latest end) over spans and requests, in ns; ``None`` if no times.

        Raw recorded values: each process's monotonic clock, not corrected by
        the instances' clock offsets (processes on one host share that clock).
        """
        lows = [b[0] for b in self._bounds(_SPAN_STARTS)]
        highs = [b[1] for b in self._bounds(_SPAN_ENDS)]
        if not lows and not highs:
            return None
        lo = min(lows) if lows else min(highs)
        hi = max(highs) if highs else max(lows)
        return lo, hi

    def _bounds(self, columns: tuple[tuple[Table, str], ...]) -> list[tuple[int, int]]:
        out = []
        for t, name in columns:
            for f in self.files(t.name):
                bounds = column_min_max(f, t, name)
                if bounds is not None:
                    out.append(bounds)
        return out

    def counters(self) -> dict[str, int]:
        """Counters summed over every writing process (``dropped`` and ``sampled_out`` always present)."""
        return dict(self.manifest["counters"])

    def instances(self) -> list[dict[str, Any]]:
        """Traced instances reported to the manifest: id, role, name, pid, host, writer."""
        return list(self.manifest["instances"])

    def dataset_glob(self, name: str) -> str:
        """Glob of table ``name``'s finished files, for DuckDB / pyarrow.dataset.

        Use with ``read_parquet(glob, hive_partitioning=true, union_by_name=true)``;
        the glob matches only ``part-*.parquet``, so temporary files are never read.
        """
        return (self.path / _table_def(name).name).as_posix() + "/instance=*/part-*.parquet"

    def info(self) -> RunInfo:
        """A :class:`RunInfo` summary of this run."""
        rows = {name: self.num_rows(name) for name in self.tables()}
        return RunInfo(self.run_id, self.path, self.created, rows, self.time_span_ns(), self.counters())


def _table_def(name: str) -> Table:
    try:
        return TABLES[name]
    except (KeyError, TypeError):
        raise StoreError(f"unknown table {name!r}; tables: {', '.join(TABLES)}") from None


def _check_columns(t: Table, columns: Sequence[str] | None) -> list[str] | None:
    if columns is None:
        return None
    if isinstance(columns, str):
        raise StoreError(f"columns must be a list of names, not the string {columns!r}")
    unknown = [c for c in columns if c not in t.names]
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise StoreError(f"table {t.name} has no column(s) {names}; columns: {', '.join(t.names)}")
    return list(columns)


def _apply_filter(result: pa.Table, expr: pc.Expression, t: Table) -> pa.Table:
    try:
        return result.filter(expr)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
        raise StoreError(f"filter {expr} cannot be applied to table {t.name}: {err}") from None


def _is_run_dir(path: Path) -> bool:
    if not path.is_dir() or is_temp_name(path.name):
        return False
    return (path / MANIFEST_NAME).is_file() or any((path / name).is_dir() for name in TABLES)


def find_run_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """The run folders of the store at ``path``, oldest first (by manifest creation time).

    ``path`` may also be a run folder itself (one holding ``manifest.json``);
    then that run alone is returned. Raises ``StoreError`` if the path is
    missing, is not a folder, is an empty folder, or holds no run folders.
    """
    p = Path(path)
    if not p.exists():
        raise StoreError(f"store path {p} does not exist")
    if not p.is_dir():
        raise StoreError(f"{p} is not a tokentrace store: it is a file, not a folder")
    if (p / MANIFEST_NAME).is_file():
        return [p]
    entries = [e for e in p.iterdir() if not is_temp_name(e.name)]
    if not entries:
        raise StoreError(f"store {p} is empty: it holds no runs yet")
    runs = [e for e in entries if _is_run_dir(e)]
    if not runs:
        raise StoreError(
            f"{p} is not a tokentrace store: none of its folders is a run (no manifest.json or table folders)"
        )
    return sorted(runs, key=_creation_key)


def _creation_key(run_dir: Path) -> tuple[str, str]:
    created = Run(run_dir).created
    if created is None:
        mtime = dt.datetime.fromtimestamp(run_dir.stat().st_mtime, dt.timezone.utc)
        created = mtime.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return created, run_dir.name


def open_run(path: str | os.PathLike[str], run: str | None = None) -> Run:
    """Open run ``run`` of the store at ``path`` (or ``path`` itself if it is a run folder).

    ``run=None`` opens the only run, or the newest one (latest ``created`` in
    its manifest; ties broken by run id). Raises ``StoreError`` for a missing
    path, a folder that is not a store, an empty store or an unknown run id
    (naming up to 10 of the available ones, newest first).
    """
    runs = find_run_dirs(path)
    if run is None:
        return _opened(runs[-1])
    for run_dir in runs:
        if run_dir.name == run:
            return _opened(run_dir)
    names = [r.name for r in reversed(runs)]
    shown = ", ".join(names[:_MAX_LISTED])
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    raise StoreError(f"unknown run id {run!r} in store {Path(path)}; available runs: {shown}{more}")


def list_runs(path: str | os.PathLike[str]) -> list[RunInfo]:
    """A :class:`RunInfo` for every run of the store at ``path``, oldest first.

    Reads manifests and file footers only (and recovers killed writers' journals).
    A run this tokentrace cannot read (newer schema version) is left out with a
    ``CorruptFileWarning``. Raises ``StoreError`` as :func:`open_run`.
    """
    infos = []
    for run_dir in find_run_dirs(path):
        try:
            infos.append(_opened(run_dir).info())
        except StoreError as err:
            warnings.warn(f"skipping {err}", CorruptFileWarning, stacklevel=2)
    return infos


def _opened(run_dir: Path) -> Run:
    """``Run(run_dir)`` after recovering killed writers' journals; ``StoreError`` if unreadable."""
    recover_run(run_dir)
    run = Run(run_dir)
    problem = manifest_problem(run.manifest)
    if problem is not None:
        raise StoreError(f"run {run.run_id} cannot be read: {problem}")
    return run
