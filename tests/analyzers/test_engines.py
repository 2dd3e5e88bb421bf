"""Every ported analysis on DuckDB and on Apache Spark (local mode) over the same stores: the same numbers.

The analyses are written once, in DuckDB SQL; the Spark engine translates each
statement with SQLGlot (``analyzers.spark_engine``). These tests run both engines
over the same stores, written as real Parquet (the Spark side reads it with
``spark.read.parquet``), and compare every result table within float tolerance:

* a hand-made disaggregated run with clock offsets (aligned times), a client
  instance (server-only views), overhanging spans (clipping to token intervals)
  and absent tables (empty views with the full schema), with hand-computed
  percentiles checked on Spark itself;
* simulated runs: disaggregated with tenants, classes, cache hits and steps (Spark
  reading it by URL, the object-storage path), colocated (in-memory Arrow tables);
* the real disaggregated run of ``tests/data/real_run`` through the whole report: every
  analysis it makes (latency, SLO attainment, goodput, stage breakdown, attribution,
  critical path, queues, cache, P:D ratio, load, batch, tenants, agreement) and every
  headline line, table and budget metric.

One local SparkSession (``local[2]``, 2 shuffle partitions, no UI, the JVM on its client JIT) serves the module.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from handmade import HandMade
from simulated import simulate

import tokentrace
from analyzers.analysis import RunAnalysis
from analyzers.engine import DuckDBEngine
from analyzers.source import Source
from analyzers.spark_engine import SPARK_INSTALL_HINT, SparkEngine, spark_session
from tokentrace.app.report import make_report
from tokentrace.schema import Role, Stage, col

REPO = Path(__file__).resolve().parents[2]
REAL_STORE = REPO / "tests" / "data" / "real_run"
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:CICompilerCount=1"
RTOL = 1e-9  # the engines sum and interpolate in different orders: equal to the last few bits


@pytest.fixture(scope="module")
def spark():
    # A JVM that lives for these tests' minutes: its client JIT alone (no C2) and the serial collector halve the CPU
    # it spends (the report on the real run: 62 s of JVM CPU against 122 s), and the results are the same.
    session = spark_session("local[2]", {"spark.sql.shuffle.partitions": "2",
                                         "spark.default.parallelism": "2",
                                         "spark.driver.memory": "1g",
                                         "spark.driver.extraJavaOptions": JVM_OPTIONS})
    yield session
    session.stop()


def _frames(value, name=""):
    """Every DataFrame (and plain value) inside an analysis result, by a dotted name."""
    if isinstance(value, pd.DataFrame):
        return {name: value}
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            out.update(_frames(getattr(value, f.name), f"{name}.{f.name}"))
        return out
    return {name: value}


def assert_same(duck, spark_result, what: str) -> None:
    """Equal results: frames cell by cell (numbers within RTOL), plain values likewise."""
    a, b = _frames(duck), _frames(spark_result)
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, pd.DataFrame):
            assert list(x.columns) == list(y.columns), f"{what}{key}"
            assert len(x) == len(y), f"{what}{key}: {len(x)} rows on duckdb, {len(y)} on spark"
            pd.testing.assert_frame_equal(x.reset_index(drop=True), y.reset_index(drop=True), check_dtype=False,
                                          rtol=RTOL, atol=1e-9, obj=f"{what}{key}")
        elif isinstance(x, float) and math.isnan(x):
            assert isinstance(y, float) and math.isnan(y), f"{what}{key}: {x!r} != {y!r}"
        elif isinstance(x, (int, float)):
            assert y == pytest.approx(x, rel=RTOL, abs=1e-12), f"{what}{key}"
        else:
            assert x == y, f"{what}{key}"


def _offsets_run(h: HandMade) -> HandMade:
    """Disaggregated, three clocks: the prefill worker 5 ms ahead of the gateway, the decode worker 3 ms behind
    (recorded time = reference time - offset); a client instance whose rows the server views must drop; no
    steps or cache events (empty views)."""
    h.instance(1, Role.GATEWAY).instance(2, Role.PREFILL, offset_ms=-5).instance(3, Role.DECODE, offset_ms=3)
    h.instance(9, Role.CLIENT)
    # request 1: arrives at 0, tokens sent at 10, 25, 45 -> TTFT 10, ITL 15 and 20
    # request 2: arrives at 5, tokens sent at 30, 40     -> TTFT 25, ITL 10
    for rid, arrival, sent, tenant, cls in ((1, 0, [10, 25, 45], "acme", "interactive"),
                                            (2, 5, [30, 40], "globex", "batch")):
        h.request(rid, arrival, sent[-1] + 1, tenant=tenant, cls=cls, prompt=64, cached=16, inst=1)
        h.tokens(rid, sent, inst=1, kind="sent")
        h.tokens(rid, [t - 1 + 5 for t in sent[:1]], inst=2)  # engine emit of token 0, on the prefill clock
        h.tokens(rid, [t - 1 - 3 for t in sent[1:]], inst=3, first=1)
        h.span(rid, Stage.GATEWAY_RECEIVE, arrival, arrival + 1, 0, inst=1)
        h.span(rid, Stage.PREFILL_COMPUTE, arrival + 1 + 5, sent[0] - 1 + 5, 0, inst=2)
        h.span(rid, Stage.STREAM_SEND, sent[0] - 1, sent[0], 0, inst=1)
        for i in range(1, len(sent)):
            # decode compute overhangs the previous token's delivery by 2 ms: clipped to (sent_{i-1}, sent_i]
            h.span(rid, Stage.DECODE_COMPUTE, sent[i - 1] - 2 - 3, sent[i] - 1 - 3, i, inst=3)
            h.span(rid, Stage.STREAM_SEND, sent[i] - 1, sent[i], i, inst=1)
        h.request(rid, arrival - 1, sent[-1] + 2, tenant=tenant, cls=cls, inst=9)  # the client's own view
        h.tokens(rid, [t + 1 for t in sent], inst=9, kind="recv")
    return h


def _disagg_sim(h: HandMade) -> HandMade:
    arrivals = [0, 3, 5, 9, 12, 20, 21, 22, 40, 41, 42, 60, 70, 71, 90, 95]
    simulate(h, arrivals, mode="disagg", prompt=120, output=6, decode_step_ms=4.0, num_prefill=2, num_decode=2,
             cached=[0, 32, 0, 64, 16, 0, 0, 96, 0, 32, 0, 0, 48, 0, 0, 16],
             tenants=["acme", "globex", "initech", "acme"] * 4, classes=["interactive", "batch"] * 8)
    return h


def _colocated_sim(h: HandMade) -> HandMade:
    simulate(h, [0, 1, 2, 10, 30, 31, 50, 52, 53, 80], mode="colocated", prompt=80, output=5, decode_step_ms=3.0,
             tenants=["a", "b"] * 5)
    return h


def _compare(duck: RunAnalysis, on_spark: RunAnalysis, methods, what: str) -> dict:
    """Run ``methods`` ((name, kwargs)) on both, assert the same results; the Spark results by name."""
    out = {}
    for method, kwargs in methods:
        result = getattr(on_spark, method)(**kwargs)
        assert_same(getattr(duck, method)(**kwargs), result, f"{what}: {method}{kwargs}")
        out[method] = result
    return out


def test_aligned_clocks_server_views_clipping_and_percentiles(spark, tmp_path):
    """The offsets run from Parquet on both engines; on Spark, the hand-computed answers:

    TTFT 10 and 25 ms and ITL 10, 15, 20 ms give numpy's linear interpolation; each decode compute span
    starts 2 ms before the previous token was sent (on the reference clock, after the decode worker's
    +3 ms offset), so only its part inside the token's interval counts, 1 ms short of the interval."""
    run = tokentrace.open(_offsets_run(HandMade()).write(tmp_path), engine="spark")
    duck, on_spark = run.analyze(engine="duckdb"), run.analyze(engine=SparkEngine(spark=spark))
    assert isinstance(duck.source.engine, DuckDBEngine) and isinstance(on_spark.source.engine, SparkEngine)
    got = _compare(duck, on_spark, [("latency", {}), ("stage_breakdown", {}), ("slo", {})], "offsets")
    lat = got["latency"].set_index("metric")
    assert lat.loc["ttft", "count"] == 2 and lat.loc["itl", "count"] == 3
    assert lat.loc["ttft", "p50_ms"] == pytest.approx(17.5)  # 10 + 0.5 * (25 - 10)
    assert lat.loc["ttft", "p90_ms"] == pytest.approx(23.5)  # 10 + 0.9 * 15
    assert lat.loc["itl", "p50_ms"] == pytest.approx(15.0)
    assert lat.loc["itl", "p90_ms"] == pytest.approx(19.0)  # rank 1.8 of [10, 15, 20]
    assert lat.loc["itl", "mean_ms"] == pytest.approx(15.0)
    bd = got["stage_breakdown"].set_index("stage")
    # ITL tokens: (10, 25], (25, 45], (30, 40]; decode compute covers each up to 1 ms before its end
    assert bd.loc[Stage.DECODE_COMPUTE.label, "itl_mean_ms"] == pytest.approx((14 + 19 + 9) / 3)
    assert bd.loc[Stage.STREAM_SEND.label, "itl_mean_ms"] == pytest.approx(1.0)
    assert bd["itl_share"].sum() == pytest.approx(1.0)
    on_spark.source.close()


def test_groupings_and_cache_on_a_simulated_run_read_by_url(spark, tmp_path):
    """Tenants, classes, cache hits, two prefill and two decode instances with steps, from Parquet; Spark
    reads the run by its URL (``Source.of_url``, the object-storage path, here ``file://``)."""
    run = tokentrace.open(_disagg_sim(HandMade()).write(tmp_path))
    url = run.path.as_uri()
    assert url.startswith("file://")
    duck = RunAnalysis(run)
    on_spark = RunAnalysis.of(Source.of_url(url, engine=SparkEngine(spark=spark)))
    assert on_spark.source.present == duck.source.present
    got = _compare(duck, on_spark, [("latency", {"by": "tenant"}), ("stage_breakdown", {"by": "slo_class"}),
                                    ("cache", {})], "disagg")
    assert set(got["latency"][col.TENANT]) == {"acme", "globex", "initech"}
    assert got["cache"].prefix["cached_tokens"].sum() > 0
    on_spark.source.close()


def test_in_memory_tables_register_on_spark_and_absent_ones_have_every_column(spark):
    """``Source.of_tables`` on Spark (a colocated simulated run): Arrow tables registered; the tables not
    given (cache events, loop lags, ...) read as empty views with the full schema on both engines."""
    given = {n: t for n, t in _colocated_sim(HandMade()).tables().items()
             if n in ("requests", "tokens", "spans", "steps", "instances")}
    duck = RunAnalysis.of(Source.of_tables(**given))
    on_spark = RunAnalysis.of(Source.of_tables(engine=SparkEngine(spark=spark), **given))
    _compare(duck, on_spark, [("latency", {"window_s": 0.02}), ("cache", {})], "colocated")
    assert on_spark.source.scalar("SELECT COUNT(*) FROM cache_events") == 0
    assert on_spark.source.engine.columns("cache_events") == duck.source.engine.columns("cache_events")
    on_spark.source.close()


@pytest.mark.timeout(600)  # every analysis of the report twice, one of them on Spark: minutes on a busy machine
def test_the_report_on_the_real_run_is_the_same_on_both_engines(spark):
    """Every section, table, headline line and budget metric of the report, DuckDB against Spark."""
    duck = make_report(REAL_STORE)
    on_spark = make_report(REAL_STORE, engine="spark")
    assert on_spark.headline == duck.headline
    assert [s.key for s in on_spark.sections] == [s.key for s in duck.sections]
    for a, b in zip(duck.sections, on_spark.sections):
        assert b.note == a.note, a.key
        assert [c for c, _ in b.tables] == [c for c, _ in a.tables], a.key
        for (caption, x), (_, y) in zip(a.tables, b.tables):
            assert_same(x, y, f"{a.key}: {caption}")
    assert on_spark.metrics.keys() == duck.metrics.keys()
    for key, value in duck.metrics.items():
        other = on_spark.metrics[key]
        assert (math.isnan(value) and math.isnan(other)) or other == pytest.approx(value, rel=RTOL), key
    assert len(duck.metrics) > 20 and np.isfinite(duck.metrics["ttft.p99"])


def _cli(args: list[str], *, env: dict[str, str] | None = None, pre: str = "") -> subprocess.CompletedProcess:
    code = f"{pre}import sys; from tokentrace.app.cli import main; sys.argv = ['tokentrace'] + {args!r}; main()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=env)


def test_report_without_pyspark_says_what_to_install():
    done = _cli(["report", str(REAL_STORE), "--engine", "spark"],
                pre="import sys; sys.modules['pyspark'] = None; ")  # as if the extra were not installed
    assert done.returncode == 2, done.stderr
    assert SPARK_INSTALL_HINT in done.stderr and "Traceback" not in done.stderr


def test_report_without_java_says_what_to_install():
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(Path(sys.executable).parent)  # the venv's scripts, no java
    done = _cli(["report", str(REAL_STORE), "--engine", "spark", "--spark-master", "local[1]"], env=env)
    assert done.returncode == 2, done.stderr
    assert "Java runtime" in done.stderr and "Traceback" not in done.stderr


def test_duckdb_refuses_a_run_url_in_one_sentence():
    with pytest.raises(ValueError, match="engine='spark'"):
        Source.of_url("s3a://bucket/store/run-1", engine="duckdb")


def test_an_unknown_engine_is_refused_in_one_sentence():
    done = _cli(["report", str(REAL_STORE), "--engine", "trino"])
    assert done.returncode == 2 and "unknown engine 'trino'" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(ValueError, match="unknown engine"):
        tokentrace.open(REAL_STORE, engine="trino")


def test_only_the_spark_module_imports_pyspark_or_sqlglot():
    found = []
    for pkg in ("tokentrace", "instrument", "analyzers", "dashboard", "reference_server"):
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n.split(".")[0] in ("pyspark", "sqlglot") for n in names):
                    found.append(path.relative_to(REPO).as_posix())
    assert set(found) == {"analyzers/spark_engine.py"}
    code = ("import sys, tokentrace, analyzers.analysis, tokentrace.app.report; "
            "tokentrace.open(sys.argv[1]).analyze().latency(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'sqlglot', 'py4j')))")
    done = subprocess.run([sys.executable, "-c", code, str(REAL_STORE)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_saved_fact_equals_the_fact_built_now_on_spark(spark, tmp_path):
    """The facts' door on Spark: each fact of the registry read from the run's saved file (written by DuckDB) and
    built now by Spark from the part files give the same columns, types and rows."""
    import shutil

    import pyarrow as pa

    from analyzers import facts
    from analyzers.derivation import FACTS, derive

    shutil.copytree(REAL_STORE, tmp_path / "real")
    run = tokentrace.open(tmp_path / "real")
    derive(run)
    saved = Source.of_run(run, engine=SparkEngine(spark=spark))
    built = Source.of_run(run, engine=SparkEngine(spark=spark))
    built._cache["saved_facts"] = {}  # this source builds every fact from the part files
    try:
        for fact in FACTS:
            assert facts.is_saved(saved, fact) and not facts.is_saved(built, fact), fact.name
            a = saved.arrow(fact.rows_sql(facts.relation(saved, fact)))
            b = built.arrow(fact.rows_sql(facts.relation(built, fact)))
            assert a.schema.names == b.schema.names == list(fact.names), fact.name
            assert [f.type for f in a.schema] == [f.type for f in b.schema] == [c.type for c in fact.columns]
            keys = [n for n, t in zip(fact.names, a.schema.types) if not pa.types.is_list(t)]
            fa = a.to_pandas().sort_values(keys, kind="stable").reset_index(drop=True)
            fb = b.to_pandas().sort_values(keys, kind="stable").reset_index(drop=True)
            for name, t in zip(fact.names, a.schema.types):
                if pa.types.is_list(t):
                    for x, y in zip(fa[name], fb[name]):
                        np.testing.assert_allclose(np.asarray(x, float), np.asarray(y, float), rtol=RTOL)
                    fa, fb = fa.drop(columns=name), fb.drop(columns=name)
            pd.testing.assert_frame_equal(fa, fb, check_exact=False, rtol=RTOL, obj=fact.name)
            assert len(fa) or fact.name.startswith("spec_"), fact.name  # the real run did not speculate
            if fact.select_only is not None:  # some rows, built for their keys alone on Spark
                alone = Source.of_run(run, engine=SparkEngine(spark=spark))
                alone._cache["saved_facts"] = {}
                try:
                    some = fa[list(fact.keys)].iloc[::3].drop_duplicates().reset_index(drop=True)
                    alone.register("some_keys", some)
                    got = alone.df(facts.rows_for(alone, fact, "some_keys"))
                    assert not facts.is_at_hand(alone, fact), fact.name
                finally:
                    alone.close()
                want = fa.merge(some, on=list(fact.keys))
                got = got.sort_values(keys, kind="stable").reset_index(drop=True)
                pd.testing.assert_frame_equal(want.sort_values(keys, kind="stable").reset_index(drop=True),
                                              got.astype(want.dtypes.to_dict()), check_exact=False, rtol=RTOL,
                                              obj=f"{fact.name}: rows_for")
    finally:
        saved.close()
        built.close()


def test_query_parameters_on_both_engines(spark):
    given = {n: t for n, t in _colocated_sim(HandMade()).tables().items() if n in ("requests", "instances")}
    sql = f"SELECT COUNT(*) AS n FROM requests WHERE {col.REQUEST_ID} = ? OR {col.TENANT} = ?"
    rid = int(given["requests"].column(col.REQUEST_ID)[0].as_py())
    duck = Source.of_tables(**given)
    on_spark = Source.of_tables(engine=SparkEngine(spark=spark), **given)
    try:
        expected = int(duck.df(sql, [rid, "no such tenant"])["n"][0])
        assert expected >= 1
        assert int(on_spark.df(sql, [rid, "no such tenant"])["n"][0]) == expected
    finally:
        duck.close()
        on_spark.close()


@pytest.mark.timeout(600)
def test_the_diagnosis_is_the_same_on_both_engines(spark):
    """Every missed request's causes, gaps and the ranked summary of the real run, class targets and tighter
    ones, DuckDB against Spark (the diagnosis's SQL translated; its rules run on the fetched rows)."""
    run = tokentrace.open(REAL_STORE)
    duck, on_spark = run.analyze(engine="duckdb"), run.analyze(engine=SparkEngine(spark=spark))
    got = _compare(duck, on_spark, [("diagnosis", {}), ("diagnosis", {"ttft_ms": 200.0, "itl_ms": 30.0})], "real")
    assert got["diagnosis"].num_missed > 0 and "burst" in set(got["diagnosis"].summary["cause"])
    on_spark.source.close()
