"""The SQL engines the analyses run on, behind one small interface.

Every analysis is written once, as DuckDB SQL over the views of
:class:`analyzers.source.Source`. An :class:`Engine` runs that SQL:

* :class:`DuckDBEngine` (the default, embedded): the SQL as written, on a private
  in-process DuckDB connection.
* ``analyzers.spark_engine.SparkEngine`` (the ``[spark]`` extra): each statement
  translated from DuckDB's dialect to Spark's by SQLGlot and run by a
  ``SparkSession`` (local or a cluster); imported only when asked for, so the rest
  of tokentrace never imports PySpark.

:func:`open_engine` builds one by name. The interface is what the analyzers
need and no more: run statements (temporary tables and views included), fetch a
result as pandas (with ``?`` parameters), Arrow, a stream of Arrow batches or one row, register an in-memory table, list a
relation's columns, and open a run's Parquet parts as a view.

Both engines compute percentiles the same way: exact and linearly interpolated
between the two nearest ranks (numpy's default; DuckDB's ``quantile_cont``,
Spark's ``percentile``), never an approximation.

Not thread-safe: one engine per thread.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import pandas as pd
import pyarrow as pa

__all__ = ["Engine", "DuckDBEngine", "ParquetGroup", "ENGINES", "DEFAULT_ENGINE", "open_engine"]

ENGINES: tuple[str, ...] = ("duckdb", "spark")
"""Engine names :func:`open_engine` accepts."""
DEFAULT_ENGINE = "duckdb"

ParquetGroup = tuple[Sequence[str], Mapping[str, str]]
"""Part files of one schema version (paths or URLs) and the column renames that bring them to the current schema."""


class Engine(Protocol):
    """What a :class:`~analyzers.source.Source` needs of a SQL engine. SQL is DuckDB's dialect."""

    name: str

    def execute(self, sql: str) -> None:
        """Run one or more ``;``-separated statements (``CREATE [OR REPLACE] TEMP TABLE|VIEW``, ``DROP``, ...)."""

    def df(self, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame:
        """The result of one query as a pandas DataFrame; ``params``: values of its ``?`` placeholders, in order."""

    def fetchone(self, sql: str) -> tuple[Any, ...] | None:
        """The first row of one query (``None`` when it has none)."""

    def arrow(self, sql: str) -> pa.Table:
        """The result of one query as an Arrow table."""

    def arrow_stream(self, sql: str, batch_rows: int) -> pa.RecordBatchReader:
        """The result of one query as a stream of record batches (at most ``batch_rows`` rows each), for writing
        a result bigger than memory."""

    def register(self, name: str, table: pa.Table | pd.DataFrame) -> None:
        """Make an in-memory table queryable as ``name`` (replacing one of that name)."""

    def unregister(self, name: str) -> None:
        """Forget a table registered with :meth:`register`."""

    def columns(self, relation: str) -> list[str]:
        """Column names of a table or view."""

    def parquet_view(self, name: str, groups: Sequence[ParquetGroup]) -> None:
        """View ``name`` over Parquet files: each group's columns renamed, the groups unioned by column name."""

    def close(self) -> None:
        """Release what the engine holds (a connection; temporary views)."""


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class DuckDBEngine:
    """The analyses' SQL as written, on a private in-process DuckDB connection."""

    name = "duckdb"

    def __init__(self, con: Any = None) -> None:
        import duckdb

        if con is None:
            con = duckdb.connect()
            # DuckDB draws its own progress bar on stderr for queries past 2 s: noise in the output of
            # ``tokentrace run`` and the dashboard's log, which say what they do in their own words.
            con.execute("SET enable_progress_bar = false")
        self.con = con

    def execute(self, sql: str) -> None:
        self.con.execute(sql)

    def df(self, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame:
        return (self.con.execute(sql, list(params)) if params else self.con.execute(sql)).df()

    def fetchone(self, sql: str) -> tuple[Any, ...] | None:
        rows = self.con.execute(sql).fetchall()  # read to the end: the connection then takes other work
        return rows[0] if rows else None

    def arrow(self, sql: str) -> pa.Table:
        return self.con.sql(sql).to_arrow_table()

    def arrow_stream(self, sql: str, batch_rows: int) -> pa.RecordBatchReader:
        self.con.execute("SELECT 1").fetchall()  # finishes a result a previous query left open, which blocks streaming
        return self.con.sql(sql).to_arrow_reader(batch_rows)

    def register(self, name: str, table: pa.Table | pd.DataFrame) -> None:
        self.con.register(name, table)

    def unregister(self, name: str) -> None:
        self.con.unregister(name)

    def columns(self, relation: str) -> list[str]:
        return [row[0] for row in self.con.execute(f"DESCRIBE SELECT * FROM {relation}").fetchall()]

    def parquet_view(self, name: str, groups: Sequence[ParquetGroup]) -> None:
        parts = []
        for paths, renames in groups:
            listed = ", ".join(_sql_string(p) for p in paths)
            scan = f"read_parquet([{listed}], union_by_name = true, hive_partitioning = false)"
            if not renames:
                parts.append(f"SELECT * FROM {scan}")
                continue
            cols = ", ".join(f'"{c}" AS "{renames.get(c, c)}"' for c in self.columns(scan))
            parts.append(f"SELECT {cols} FROM {scan}")
        self.con.execute(f"CREATE VIEW {name} AS " + " UNION ALL BY NAME ".join(f"({p})" for p in parts))

    def close(self) -> None:
        self.con.close()


def open_engine(engine: "str | Engine | None" = None, **options: Any) -> "Engine":
    """An engine by name (``"duckdb"``, the default, or ``"spark"``), or ``engine`` itself if it is one.

    ``options`` go to the engine (Spark: ``master``, ``spark`` for an existing
    ``SparkSession``, ``conf``). ``ValueError`` for an unknown name; for Spark
    without PySpark or Java, ``analyzers.spark_engine.SparkUnavailableError`` (a ``RuntimeError``) that
    says what to install.
    """
    if engine is None or engine == "duckdb":
        if options:
            raise ValueError(f"the duckdb engine takes no options, got {', '.join(sorted(options))}")
        return DuckDBEngine()
    if engine == "spark":
        from analyzers.spark_engine import SparkEngine

        return SparkEngine(**options)
    if isinstance(engine, str):
        raise ValueError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")
    return engine
