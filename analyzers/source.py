"""The input of every analyzer: a run's tables as clock-aligned views of one SQL engine.

A :class:`Source` owns an engine (:mod:`analyzers.engine`: a private DuckDB
connection by default, or Spark) holding one view per store
table (``requests``, ``spans``, ``tokens``, ``steps``, ``cache_events``,
``instances``), every time column already shifted onto the run's reference
clock (``t_ref = t_local + clock_offset_ns``, see :mod:`tokentrace.clock.alignment`).
Two more views hold the server's side only (client-role rows removed):
``srv_requests`` and ``srv_tokens``; ``srv_spans`` likewise. A run whose every instance is a
client (no server was traced) has no server lane: there the views keep the client's rows, so the
analyses report what the client measured, and :attr:`Source.client_lane_only` says so.

* :meth:`Source.of_run` reads the run's Parquet files through the engine
  (DuckDB's ``read_parquet``, Spark's ``spark.read.parquet``): nothing is loaded
  until a query runs, and aggregations stream over stores bigger than memory. Unreadable files are skipped (the
  store reader warns about them); files of older schema versions read with
  their missing columns as nulls.
* :meth:`Source.of_tables` wraps small in-memory Arrow tables (tests, callers
  that already hold tables).

A table that is absent reads as an empty view with the full schema, so every
query runs and analyzers return empty results rather than raising.

Derived facts (per-token and per-request tables several analyses share) are read
through one door, :func:`analyzers.facts.relation`: the run's saved copy when it is
current (looked up once by :meth:`Source.of_run`), else built once per ``Source`` as
a temporary table.

The views are described once, in DuckDB SQL (:meth:`Source._build`), and every
query goes through :meth:`Source.df`, :meth:`Source.scalar`,
:meth:`Source.fetchone`, :meth:`Source.execute` and :meth:`Source.register`, so
an analysis written for DuckDB runs unchanged on any engine (Spark translates
it, :mod:`analyzers.spark_engine`).

Not thread-safe: use one ``Source`` per thread.
"""

from __future__ import annotations

from typing import Any, Mapping

import pandas as pd
import pyarrow as pa

from analyzers.engine import DuckDBEngine, Engine, ParquetGroup, open_engine
from analyzers.facts import attach
from tokentrace.clock import OFFSET_COLUMN, RunClocks, aligned_time_sql, latest_instances, time_columns
from tokentrace.schema import INSTANCES, TABLES, Role, Table, col

__all__ = ["Source", "SERVER_VIEWS"]

SERVER_VIEWS: dict[str, str] = {"requests": "srv_requests", "tokens": "srv_tokens", "spans": "srv_spans"}
"""Store table -> view of its server-side rows (client-role instances removed)."""

_DUCK_TYPES = {pa.int8(): "TINYINT", pa.int32(): "INTEGER", pa.int64(): "BIGINT", pa.string(): "VARCHAR"}


class Source:
    """A run's tables as aligned views of an engine; build with :meth:`of_run` or :meth:`of_tables`.

    ``engine``: an :class:`~analyzers.engine.Engine` (a DuckDB connection is wrapped as one).
    """

    def __init__(self, engine: Any, *, manifest: Mapping[str, Any] | None = None,
                 present: frozenset[str] = frozenset(), client_lane_only: bool = False) -> None:
        self.engine: Engine = engine if hasattr(engine, "parquet_view") else DuckDBEngine(engine)
        self.client_lane_only = client_lane_only  # no server instance: the srv_ views hold the client's rows
        self.manifest: dict[str, Any] = dict(manifest or {})
        self.present = present  # tables with at least one row source
        self._cache: dict[str, Any] = {}

    # ------------------------------------------------------------ construction

    @classmethod
    def of_tables(cls, *, manifest: Mapping[str, Any] | None = None, engine: Any = None,
                  **tables: pa.Table) -> "Source":
        """A source over in-memory Arrow tables named like the store tables (``spans=...``).

        ``engine``: ``"duckdb"`` (default), ``"spark"`` or an :class:`~analyzers.engine.Engine`.
        ``ValueError`` for a name that is not a store table.
        """
        unknown = [n for n in tables if n not in TABLES]
        if unknown:
            raise ValueError(f"unknown table(s) {', '.join(unknown)}; tables: {', '.join(TABLES)}")
        eng = open_engine(engine)
        raw: dict[str, str] = {}
        for name, t in tables.items():
            if t is None:
                continue
            eng.register(f"raw_{name}", t)
            raw[name] = f"raw_{name}"
        instances = tables.get(INSTANCES.name)
        return cls._build(eng, raw, instances, manifest,
                          frozenset(n for n, t in tables.items() if t is not None and t.num_rows))

    @classmethod
    def of_run(cls, run: Any, *, engine: Any = None) -> "Source":
        """A source streaming over the Parquet files of ``run`` (a ``tokentrace.store.reader.Run``).

        ``engine``: ``"duckdb"`` (default), ``"spark"`` or an :class:`~analyzers.engine.Engine`.
        """
        eng = open_engine(engine)
        raw: dict[str, str] = {}
        present = set()
        for name in TABLES:
            if name == INSTANCES.name:
                continue
            groups = _parquet_groups(run.files(name), name)
            if not groups:
                continue
            eng.parquet_view(f"raw_{name}", groups)
            raw[name] = f"raw_{name}"
            present.add(name)
        instances = run.table(INSTANCES.name)
        if instances.num_rows:
            present.add(INSTANCES.name)
        try:
            manifest = run.manifest
        except (OSError, ValueError):
            manifest = {}
        src = cls._build(eng, raw, instances, manifest, frozenset(present))
        attach(src, run)  # the run's current saved facts, for the facts' door (analyzers.facts)
        return src

    @classmethod
    def of_url(cls, url: str, *, engine: Any = "spark") -> "Source":
        """A source over the run folder at ``url`` in object storage or HDFS (``s3a://bucket/store/run``),
        read by an engine that reaches such URLs (Spark: ``"spark"`` or a ``SparkEngine``).

        ``ValueError`` when the engine cannot read URLs (DuckDB here: copy the run, or use ``of_run``).
        """
        eng = open_engine(engine)
        if not hasattr(eng, "run_url_views"):
            raise ValueError(f"the {eng.name} engine reads local runs only (Source.of_run); "
                             f"read {url} with engine='spark'")
        tables = [n for n in TABLES]
        present, instances, manifest = eng.run_url_views(url, tables)
        raw = {n: f"raw_{n}" for n in present if n != INSTANCES.name}
        return cls._build(eng, raw, instances, manifest, present)

    @classmethod
    def _build(cls, eng: Engine, raw: dict[str, str], instances: pa.Table | None,
               manifest: Mapping[str, Any] | None, present: frozenset[str]) -> "Source":
        """The views every analysis reads, described once (DuckDB SQL) for every engine."""
        inst = latest_instances(instances) if instances is not None else INSTANCES.schema.empty_table()
        eng.register("instances", inst)
        clocks = RunClocks.from_instances(inst)
        clients = client_instance_ids(inst)
        eng.register("clock_offsets", clocks.offsets_table())
        shifted = clocks.is_shifted
        for name, t in TABLES.items():
            if name == INSTANCES.name:
                continue
            if name not in raw:
                eng.register(f"raw_{name}", t.schema.empty_table())
                raw[name] = f"raw_{name}"
            eng.execute(f"CREATE VIEW {name} AS {_aligned_select(eng.columns(raw[name]), raw[name], t, shifted)}")
        client_lane_only = bool(clients) and len(clients) == inst.num_rows
        not_client = (f"WHERE {col.INSTANCE_ID} NOT IN ({', '.join(map(str, clients))})"
                      if clients and not client_lane_only else "")
        for name, view in SERVER_VIEWS.items():
            eng.execute(f"CREATE VIEW {view} AS SELECT * FROM {name} {not_client}")
        return cls(eng, manifest=manifest, present=present, client_lane_only=client_lane_only)

    # ------------------------------------------------------------ queries

    def df(self, sql: str, params: list[Any] | None = None) -> pd.DataFrame:
        """Run the query ``sql`` and return a pandas DataFrame; ``params``: values of its ``?`` placeholders, in
        order."""
        return self.engine.df(sql, params)

    def scalar(self, sql: str) -> Any:
        """The first column of the first row of ``sql`` (``None`` if no rows)."""
        row = self.engine.fetchone(sql)
        return None if row is None else row[0]

    def fetchone(self, sql: str) -> tuple[Any, ...] | None:
        """The first row of the query ``sql`` (``None`` if no rows)."""
        return self.engine.fetchone(sql)

    def arrow(self, sql: str) -> pa.Table:
        """The result of the query ``sql`` as an Arrow table."""
        return self.engine.arrow(sql)

    def arrow_stream(self, sql: str, batch_rows: int) -> pa.RecordBatchReader:
        """The result of the query ``sql`` as a stream of record batches of at most ``batch_rows`` rows."""
        return self.engine.arrow_stream(sql, batch_rows)

    def execute(self, sql: str) -> None:
        """Run statements (``CREATE [OR REPLACE] TEMP TABLE t AS ...``, ``DROP TABLE ...``), ``;``-separated."""
        self.engine.execute(sql)

    def register(self, name: str, table: pa.Table | pd.DataFrame) -> None:
        """Make an in-memory table queryable as ``name``."""
        self.engine.register(name, table)

    def unregister(self, name: str) -> None:
        """Forget a table made queryable with :meth:`register`."""
        self.engine.unregister(name)

    def close(self) -> None:
        """Release the engine's connection or temporary views; the source is unusable afterwards."""
        self.engine.close()

    def is_cached(self, key: str) -> bool:
        """True when :meth:`cached` has built ``key`` already (an analysis may then reuse it instead of a
        cheaper query of its own)."""
        return key in self._cache

    def cached(self, key: str, build: Any) -> Any:
        """``build()`` once per source and key; later calls return the same object."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def _parquet_groups(files: list[Any], name: str) -> list[ParquetGroup]:
    """The readable part files of table ``name`` grouped by schema version, each with the renames that undo
    that version's older column names (the engine unions the groups by column name). Empty when no file is
    readable (unreadable ones warn through ``part_info``).
    """
    from tokentrace.store.files import part_info, renames_since

    by_version: dict[int, list[str]] = {}
    for f in files:
        info = part_info(f)
        if info is not None:
            by_version.setdefault(info.schema_version, []).append(f.as_posix())
    return [(paths, renames_since(version, name)) for version, paths in sorted(by_version.items())]


def _aligned_select(columns: list[str], raw: str, t: Table, shifted: bool) -> str:
    """SELECT of every schema column of ``t`` from ``raw`` (which has ``columns``; missing ones as nulls),
    times aligned."""
    have = set(columns)
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
