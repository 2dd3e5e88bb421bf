"""The input of every analyzer: a run's tables as clock-aligned DuckDB views.

A :class:`Source` owns a private DuckDB connection holding one view per store
table (``requests``, ``spans``, ``tokens``, ``steps``, ``cache_events``,
``instances``), every time column already shifted onto the run's reference
clock (``t_ref = t_local + clock_offset_ns``, see :mod:`tokentrace.clock.alignment`).
Two more views hold the server's side only (client-role rows removed):
``srv_requests`` and ``srv_tokens``; ``srv_spans`` likewise.

* :meth:`Source.of_run` reads the run's Parquet files through DuckDB's
  ``read_parquet``: nothing is loaded until a query runs, and aggregations
  stream over stores bigger than memory. Unreadable files are skipped (the
  store reader warns about them); files of older schema versions read with
  their missing columns as nulls.
* :meth:`Source.of_tables` wraps small in-memory Arrow tables (tests, callers
  that already hold tables).

A table that is absent reads as an empty view with the full schema, so every
query runs and analyzers return empty results rather than raising.

Derived per-token and per-request facts (:mod:`analyzers.timing`) are
materialized once per ``Source`` as temporary tables and cached.

Not thread-safe: use one ``Source`` per thread.
"""

from __future__ import annotations

from typing import Any, Mapping

import duckdb
import pandas as pd
import pyarrow as pa

from tokentrace.clock import OFFSET_COLUMN, RunClocks, aligned_time_sql, latest_instances, time_columns
from tokentrace.schema import INSTANCES, TABLES, Role, Table, col

__all__ = ["Source", "SERVER_VIEWS"]

SERVER_VIEWS: dict[str, str] = {"requests": "srv_requests", "tokens": "srv_tokens", "spans": "srv_spans"}
"""Store table -> view of its server-side rows (client-role instances removed)."""

_DUCK_TYPES = {pa.int8(): "TINYINT", pa.int32(): "INTEGER", pa.int64(): "BIGINT", pa.string(): "VARCHAR"}


class Source:
    """A run's tables as aligned DuckDB views; build with :meth:`of_run` or :meth:`of_tables`."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, manifest: Mapping[str, Any] | None = None,
                 present: frozenset[str] = frozenset()) -> None:
        self.con = con
        self.manifest: dict[str, Any] = dict(manifest or {})
        self.present = present  # tables with at least one row source
        self._cache: dict[str, Any] = {}

    # ------------------------------------------------------------ construction

    @classmethod
    def of_tables(cls, *, manifest: Mapping[str, Any] | None = None, **tables: pa.Table) -> "Source":
        """A source over in-memory Arrow tables named like the store tables (``spans=...``).

        ``ValueError`` for a name that is not a store table.
        """
        unknown = [n for n in tables if n not in TABLES]
        if unknown:
            raise ValueError(f"unknown table(s) {', '.join(unknown)}; tables: {', '.join(TABLES)}")
        con = duckdb.connect()
        raw: dict[str, str] = {}
        for name, t in tables.items():
            if t is None:
                continue
            con.register(f"raw_{name}", t)
            raw[name] = f"raw_{name}"
        instances = tables.get(INSTANCES.name)
        return cls._build(con, raw, instances, manifest,
                          frozenset(n for n, t in tables.items() if t is not None and t.num_rows))

    @classmethod
    def of_run(cls, run: Any) -> "Source":
        """A source streaming over the Parquet files of ``run`` (a ``tokentrace.store.reader.Run``)."""
        con = duckdb.connect()
        raw: dict[str, str] = {}
        present = set()
        for name in TABLES:
            if name == INSTANCES.name:
                continue
            select = _parquet_select(con, run.files(name), name)
            if select is None:
                continue
            con.execute(f"CREATE VIEW raw_{name} AS {select}")
            raw[name] = f"raw_{name}"
            present.add(name)
        instances = run.table(INSTANCES.name)
        if instances.num_rows:
            present.add(INSTANCES.name)
        try:
            manifest = run.manifest
        except (OSError, ValueError):
            manifest = {}
        return cls._build(con, raw, instances, manifest, frozenset(present))

    @classmethod
    def _build(cls, con: duckdb.DuckDBPyConnection, raw: dict[str, str], instances: pa.Table | None,
               manifest: Mapping[str, Any] | None, present: frozenset[str]) -> "Source":
        inst = latest_instances(instances) if instances is not None else INSTANCES.schema.empty_table()
        con.register("instances", inst)
        clocks = RunClocks.from_instances(inst)
        clients = client_instance_ids(inst)
        con.register("clock_offsets", clocks.offsets_table())
        shifted = clocks.is_shifted
        for name, t in TABLES.items():
            if name == INSTANCES.name:
                continue
            if name not in raw:
                con.register(f"raw_{name}", t.schema.empty_table())
                raw[name] = f"raw_{name}"
            con.execute(f"CREATE VIEW {name} AS {_aligned_select(con, raw[name], t, shifted)}")
        not_client = f"WHERE {col.INSTANCE_ID} NOT IN ({', '.join(map(str, clients))})" if clients else ""
        for name, view in SERVER_VIEWS.items():
            con.execute(f"CREATE VIEW {view} AS SELECT * FROM {name} {not_client}")
        return cls(con, manifest=manifest, present=present)

    # ------------------------------------------------------------ queries

    def df(self, sql: str, params: list[Any] | None = None) -> pd.DataFrame:
        """Run ``sql`` on this source's connection and return a pandas DataFrame."""
        return self.con.execute(sql, params or []).df()

    def scalar(self, sql: str) -> Any:
        """The first column of the first row of ``sql`` (``None`` if no rows)."""
        row = self.con.execute(sql).fetchone()
        return None if row is None else row[0]

    def is_cached(self, key: str) -> bool:
        """True when :meth:`cached` has built ``key`` already (an analysis may then reuse it instead of a
        cheaper query of its own)."""
        return key in self._cache

    def cached(self, key: str, build: Any) -> Any:
        """``build()`` once per source and key; later calls return the same object."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def _parquet_select(con: duckdb.DuckDBPyConnection, files: list[Any], name: str) -> str | None:
    """SELECT over the readable part files of table ``name``, older schema versions' renames undone.

    Files are grouped by schema version; each group's columns are renamed as the
    reader's migrations say, and the groups are unioned by column name. ``None``
    when no file is readable (unreadable ones warn through ``part_info``).
    """
    from tokentrace.store.files import part_info, renames_since

    by_version: dict[int, list[str]] = {}
    for f in files:
        info = part_info(f)
        if info is not None:
            by_version.setdefault(info.schema_version, []).append(f.as_posix())
    parts = []
    for version, paths in sorted(by_version.items()):
        listed = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)  # SQL string literals
        scan = f"read_parquet([{listed}], union_by_name = true, hive_partitioning = false)"
        renames = renames_since(version, name)
        if not renames:
            parts.append(f"SELECT * FROM {scan}")
            continue
        have = [row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {scan}").fetchall()]
        cols = ", ".join(f'"{c}" AS "{renames.get(c, c)}"' for c in have)
        parts.append(f"SELECT {cols} FROM {scan}")
    return " UNION ALL BY NAME ".join(f"({p})" for p in parts) if parts else None


def _aligned_select(con: duckdb.DuckDBPyConnection, raw: str, t: Table, shifted: bool) -> str:
    """SELECT of every schema column of ``t`` from ``raw`` (missing ones as nulls), times aligned."""
    have = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {raw}").fetchall()}
    times = set(time_columns(t.name))
    parts = []
    for c in t.columns:
        if c.name not in have:
            parts.append(f"CAST(NULL AS {_DUCK_TYPES[c.type]}) AS {c.name}")
        elif shifted and c.name in times:
            aligned = aligned_time_sql(f"r.{c.name}", f"o.{OFFSET_COLUMN}")
            parts.append(f"CAST({aligned} AS {_DUCK_TYPES[c.type]}) AS {c.name}")
        else:
            parts.append(f"CAST(r.{c.name} AS {_DUCK_TYPES[c.type]}) AS {c.name}")
    join = f" LEFT JOIN clock_offsets o ON r.{col.INSTANCE_ID} = o.{col.INSTANCE_ID}" if shifted else ""
    return f"SELECT {', '.join(parts)} FROM {raw} r{join}"


def client_instance_ids(instances: pa.Table) -> list[int]:
    """Instances whose role is ``client`` (the load generator's independent view)."""
    inst = latest_instances(instances)
    return [i for i, r in zip(inst.column(col.INSTANCE_ID).to_pylist(), inst.column(col.ROLE).to_pylist())
            if r == Role.CLIENT]
