"""The analyses on Apache Spark: the analyzers' DuckDB SQL, translated statement by statement.

:class:`SparkEngine` implements the engine interface of :mod:`analyzers.engine`
over a ``SparkSession`` (local mode by default, or any master: ``spark://``,
``yarn``, ``k8s://``). Nothing here is an analysis: each statement the
analyzers emit is parsed as DuckDB SQL by SQLGlot, adjusted where the two
engines mean different things, written as Spark SQL and run:

* ``CREATE [OR REPLACE] TEMP TABLE t AS q``: ``q`` runs and is materialized
  (``localCheckpoint``: computed once, kept on the executors) as temporary view
  ``t``; ``CREATE VIEW v AS q`` is a temporary view (lazy); ``DROP TABLE|VIEW``
  drops it.
* Percentiles: DuckDB's ``quantile_cont`` becomes Spark's ``percentile``: both
  exact and linearly interpolated (numpy's default). ``quantile_disc`` becomes
  ``percentile_disc``.
* Decimal literals (``0.5``, ``1e6``) are doubles, as they behave in DuckDB's
  arithmetic with doubles; ANSI mode is off, so a division by zero is NULL as in
  DuckDB.

Results come back as pandas DataFrames (through Arrow) with the same column
types DuckDB gives. The store's Parquet parts are read with
``spark.read.parquet`` (local paths or any Hadoop file system URL: ``s3a://``,
``abfss://``, ``gs://``, ``hdfs://``).

This is the only module of tokentrace that imports PySpark or SQLGlot (the
``[spark]`` extra), and it does so when a :class:`SparkEngine` is built. Not
thread-safe: one engine per thread (engines may share one ``SparkSession``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any, Mapping, Sequence

import pandas as pd
import pyarrow as pa

__all__ = ["SparkEngine", "SparkUnavailableError", "SPARK_INSTALL_HINT", "DEFAULT_MASTER", "DEFAULT_CONF", "spark_session", "to_spark_sql"]

SPARK_INSTALL_HINT = "pip install 'tokentrace[spark]'"
DEFAULT_MASTER = "local[*]"
DEFAULT_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",  # no web UI (and no port) for a report
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.ansi.enabled": "false",  # x / 0 is NULL, as in DuckDB
    "spark.sql.execution.arrow.pyspark.enabled": "true",  # results to pandas through Arrow
    "spark.sql.session.timeZone": "UTC",
    "spark.log.level": "FATAL",  # failed queries raise in Python; the JVM's own copy of the error is noise
}
"""Settings every session gets unless the caller sets them (``conf=``, ``--conf`` of spark-submit)."""


class SparkUnavailableError(RuntimeError):
    """Spark cannot run here: PySpark or SQLGlot is not installed, or no Java runtime starts. One sentence
    that says what to install."""


def _require_pyspark() -> Any:
    try:
        import pyspark  # noqa: F401
        import sqlglot  # noqa: F401
    except ImportError as err:
        raise SparkUnavailableError(f"the spark engine needs PySpark and SQLGlot ({err.name} is missing): "
                                    f"{SPARK_INSTALL_HINT}") from None
    import pyspark

    return pyspark


def spark_session(master: str | None = None, conf: Mapping[str, str] | None = None) -> Any:
    """The active ``SparkSession``, or a new one on ``master`` (default ``local[*]``) with :data:`DEFAULT_CONF`.

    :class:`SparkUnavailableError` naming what to install when PySpark or a Java runtime is missing.
    """
    _require_pyspark()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None and master is None and not conf:
        return active
    if not os.environ.get("JAVA_HOME") and shutil.which("java") is None:
        raise SparkUnavailableError("the spark engine needs a Java runtime (17 or 21) on PATH or in JAVA_HOME: "
                                    "e.g. apt-get install default-jre-headless")
    builder = SparkSession.builder.master(master or DEFAULT_MASTER).appName("tokentrace")
    for key, value in {**DEFAULT_CONF, **dict(conf or {})}.items():
        builder = builder.config(key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PySpark's notice about the pandas version
        try:
            session = builder.getOrCreate()
        except Exception as err:  # the JVM did not start (no Java, a wrong version, a bad master)
            first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise SparkUnavailableError(f"could not start Spark on {master or DEFAULT_MASTER}: {first_line} (the "
                                        f"spark engine needs a Java 17 or 21 runtime and {SPARK_INSTALL_HINT})"
                                        ) from None
    session.sparkContext.setLogLevel(str({**DEFAULT_CONF, **dict(conf or {})}["spark.log.level"]))
    return session


def to_spark_sql(expression: Any) -> str:
    """A parsed DuckDB expression (SQLGlot) as Spark SQL, with the engines' differences bridged."""
    from sqlglot import exp

    def fix(node: Any) -> Any:
        if isinstance(node, exp.PercentileCont):  # quantile_cont: exact, interpolated on both engines
            return exp.Anonymous(this="PERCENTILE", expressions=[node.this, node.expression])
        if isinstance(node, exp.Quantile):
            return exp.Anonymous(this="PERCENTILE", expressions=[node.this, node.args["quantile"]])
        if isinstance(node, exp.Median):
            return exp.Anonymous(this="PERCENTILE", expressions=[node.this, exp.Literal.number("0.5")])
        if isinstance(node, exp.PercentileDisc):
            return exp.WithinGroup(this=exp.Anonymous(this="PERCENTILE_DISC", expressions=[node.expression]),
                                   expression=exp.Order(expressions=[exp.Ordered(this=node.this)]))
        if (isinstance(node, exp.Literal) and not node.is_string and not node.is_int
                and not isinstance(node.parent, (exp.Array, exp.Anonymous, exp.Limit))):
            return exp.cast(node, exp.DataType.build("DOUBLE"))  # Spark reads 0.5 as DECIMAL(1,1)
        return node

    return expression.transform(fix, copy=True).sql(dialect="spark")


class SparkEngine:
    """The engine interface of :mod:`analyzers.engine` on a ``SparkSession``.

    ``spark``: a session to use (default: the active one, else a new one on
    ``master`` with ``conf``). Temporary views are named after the analyzers'
    tables and live in the session; :meth:`close` drops the ones this engine made.
    """

    name = "spark"

    def __init__(self, *, master: str | None = None, spark: Any = None, conf: Mapping[str, str] | None = None) -> None:
        self.spark = spark if spark is not None else spark_session(master, conf)
        import sqlglot

        self._sqlglot = sqlglot
        self._views: dict[str, Any] = {}  # temporary view -> its DataFrame (materialized tables are checkpointed)
        self._prefix = f"tt{id(self):x}_"  # several engines (runs) may share one session: names are per engine

    # ------------------------------------------------------------ names

    def _rename(self, expression: Any) -> Any:
        """``expression`` with every table this engine created named by its session-unique name."""
        from sqlglot import exp

        ctes = {c.alias_or_name for c in expression.find_all(exp.CTE)}
        for table in expression.find_all(exp.Table):
            if not table.args.get("db") and table.name in self._views and table.name not in ctes:
                if not table.alias:  # ``name.*`` and ``name.column`` still resolve
                    table.set("alias", exp.TableAlias(this=exp.to_identifier(table.name)))
                table.set("this", exp.to_identifier(self._prefix + table.name))
        return expression

    def _sql(self, expression: Any) -> str:
        return to_spark_sql(self._rename(expression))

    def _query(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        """One DuckDB query as a Spark DataFrame; ``params``: literals for its ``?`` placeholders, in order."""
        from sqlglot import exp

        statements = [s for s in self._sqlglot.parse(sql, read="duckdb") if s is not None]
        if len(statements) != 1:
            raise ValueError(f"expected one query, got {len(statements)} statements")
        statement = statements[0]
        if params:
            values = iter(params)
            placeholders = list(statement.find_all(exp.Placeholder))
            if len(placeholders) != len(params):
                raise ValueError(f"the query has {len(placeholders)} placeholders, got {len(params)} values")
            for node in placeholders:
                node.replace(exp.convert(next(values)))
        return self.spark.sql(self._sql(statement))

    # ------------------------------------------------------------ the engine interface

    def execute(self, sql: str) -> None:
        from sqlglot import exp

        for statement in self._sqlglot.parse(sql, read="duckdb"):
            if statement is None:
                continue
            if isinstance(statement, exp.Create) and statement.expression is not None:
                name = statement.this.name
                frame = self.spark.sql(self._sql(statement.expression))
                if str(statement.args.get("kind", "")).upper() == "TABLE":
                    frame = frame.localCheckpoint(eager=True)  # computed once, as DuckDB's temp table
                self._set(name, frame)
            elif isinstance(statement, exp.Drop):
                for table in statement.find_all(exp.Table):
                    self._drop(table.name)
            else:
                self.spark.sql(self._sql(statement)).collect()

    def df(self, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame:
        return _to_pandas(self._query(sql, params))

    def fetchone(self, sql: str) -> tuple[Any, ...] | None:
        rows = self._query(sql).take(1)
        return tuple(rows[0]) if rows else None

    def arrow(self, sql: str) -> pa.Table:
        return self._query(sql).toArrow()

    def arrow_stream(self, sql: str, batch_rows: int) -> pa.RecordBatchReader:
        frame = self._query(sql)
        schema = frame.limit(0).toArrow().schema

        def batches() -> Any:  # rows come to the driver one partition at a time, not the whole result at once
            rows: list[Any] = []
            for row in frame.toLocalIterator():
                rows.append(row)
                if len(rows) >= batch_rows:
                    yield pa.RecordBatch.from_pylist([r.asDict() for r in rows], schema=schema)
                    rows = []
            if rows:
                yield pa.RecordBatch.from_pylist([r.asDict() for r in rows], schema=schema)
        return pa.RecordBatchReader.from_batches(schema, batches())

    def register(self, name: str, table: pa.Table | pd.DataFrame) -> None:
        if isinstance(table, pd.DataFrame):
            table = pa.Table.from_pandas(table, preserve_index=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self._set(name, self.spark.createDataFrame(table))

    def unregister(self, name: str) -> None:
        self._drop(name)

    def columns(self, relation: str) -> list[str]:
        return list(self._query(f"SELECT * FROM {relation}").columns)

    def parquet_view(self, name: str, groups: Sequence[tuple[Sequence[str], Mapping[str, str]]]) -> None:
        frame = None
        for paths, renames in groups:
            part = self.spark.read.option("mergeSchema", "true").parquet(*paths)
            part = part.drop(*[c for c in part.columns if c not in renames and c.startswith("instance")
                               and c not in _STORE_COLUMNS])  # a Hive partition column inferred from the folder
            for old, new in renames.items():
                if old in part.columns:
                    part = part.withColumnRenamed(old, new)
            frame = part if frame is None else frame.unionByName(part, allowMissingColumns=True)
        if frame is not None:
            self._set(name, frame)

    def run_url_views(self, url: str, tables: Sequence[str]) -> tuple[frozenset[str], pa.Table | None, dict]:
        """Views ``raw_<table>`` over the part files of the run at ``url`` (any Hadoop file system: ``s3a://``,
        ``gs://``, ``abfss://``, ``hdfs://``, ``file://``); absent tables get none.

        Returns (tables present, the ``instances`` rows in write order or None, the run's manifest or {}).
        Reads the current schema's column names (files of schema version 0 need the local reader).
        """
        import json

        from pyspark.errors import AnalysisException
        from pyspark.sql import functions as F

        base = url.rstrip("/")
        present, instances = set(), None
        for name in tables:
            try:
                frame = (self.spark.read.option("mergeSchema", "true").option("recursiveFileLookup", "true")
                         .option("pathGlobFilter", "part-*.parquet").parquet(f"{base}/{name}"))
            except AnalysisException:  # no folder: the run has no such table
                continue
            if name == "instances":
                ordered = (frame.withColumn("_file", F.input_file_name())
                           .withColumn("_row", F.monotonically_increasing_id()).orderBy("_file", "_row"))
                instances = ordered.drop("_file", "_row").toArrow()
                present.add(name)
                continue
            self._set(f"raw_{name}", frame)
            present.add(name)
        try:
            manifest = json.loads(self.spark.read.text(f"{base}/manifest.json", wholetext=True).first()[0])
        except (AnalysisException, ValueError, TypeError):
            manifest = {}
        return frozenset(present), instances, manifest

    def close(self) -> None:
        for name in list(self._views):
            self._drop(name)

    # ------------------------------------------------------------ views

    def _set(self, name: str, frame: Any) -> None:
        self._drop(name)
        frame.createOrReplaceTempView(self._prefix + name)
        self._views[name] = frame

    def _drop(self, name: str) -> None:
        frame = self._views.pop(name, None)
        if frame is None:
            return
        self.spark.catalog.dropTempView(self._prefix + name)
        frame.unpersist()


def _store_columns() -> frozenset[str]:
    from tokentrace.schema import TABLES

    return frozenset(c.name for t in TABLES.values() for c in t.columns)


_STORE_COLUMNS = _store_columns()


def _to_pandas(frame: Any) -> pd.DataFrame:
    """``frame`` as pandas, with DuckDB's types: decimals as float64, arrays as numpy arrays."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        table = frame.toArrow()
    out = table.to_pandas()
    for field in table.schema:
        if pa.types.is_decimal(field.type):
            out[field.name] = out[field.name].astype("float64")
    return out
