"""DataSource: run ids validated against the store, results cached per (run, version, call), paging, downsampling."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from synthetic_store import write_run

from analyzers.analysis import RunAnalysis
from dashboard.data import DataSource, downsample, series_window_s, warm_calls
from tokentrace.schema import col
from tokentrace.store import StoreError


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_run(root, "one", num_requests=50, seed=1)
    write_run(root, "two", num_requests=30, seed=2)
    return root


def test_run_ids_are_validated_against_the_store(store):
    src = DataSource(store)
    assert src.resolve(None) == "two"  # the newest
    assert src.resolve("one") == "one"
    for bad in ("three", "../one", "one/../two", "/etc", ".", ""):
        if bad == "":
            assert src.resolve(bad) == "two"
            continue
        with pytest.raises(StoreError, match="is not a run of this store"):
            src.resolve(bad)


def test_missing_and_empty_stores_raise_one_sentence(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        DataSource(tmp_path / "nope").resolve(None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="is empty"):
        DataSource(tmp_path / "empty").resolve(None)


def test_results_are_cached_per_run_and_arguments(store):
    src = DataSource(store)
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert src.cached("one", "k", compute) == 1
    assert src.cached("one", "k", compute) == 1  # from the cache
    assert src.cached("two", "k", compute) == 2  # another run, another entry
    a = src.result("one", RunAnalysis.latency)
    assert src.result("one", RunAnalysis.latency) is a
    assert src.result("one", RunAnalysis.latency, by="tenant") is not a
    assert set(a["metric"]) == {"ttft", "tpot", "itl", "e2e"}


def test_live_mode_sees_new_files_of_a_run(tmp_path):
    write_run(tmp_path, "grows", num_requests=20, seed=1)
    src = DataSource(tmp_path, live=True)
    before = src.result("grows", RunAnalysis.latency)
    n_before = int(before.loc[before["metric"] == "ttft", "count"].iloc[0])
    write_run(tmp_path, "grows", num_requests=25, seed=9)  # a second writer adds its files to the same run
    after = src.result("grows", RunAnalysis.latency)
    assert int(after.loc[after["metric"] == "ttft", "count"].iloc[0]) == n_before + 25


def test_request_page_filters_sorts_and_pages(store):
    src = DataSource(store)
    rows, pages = src.request_page("one", page=0, page_size=20)
    assert len(rows) == 20 and pages == 3
    assert list(rows["e2e_ms"]) == sorted(rows["e2e_ms"], reverse=True)
    last, _ = src.request_page("one", page=99, page_size=20)  # clamped to the last page
    assert len(last) == 10
    acme, _ = src.request_page("one", tenant="acme", sort="ttft_ms", descending=False, page_size=100)
    assert set(acme[col.TENANT]) == {"acme"} and list(acme["ttft_ms"]) == sorted(acme["ttft_ms"])
    with pytest.raises(StoreError, match="cannot sort"):
        src.request_page("one", sort="colour")


def test_request_trace_checks_the_id_and_aligns_rows(store):
    src = DataSource(store)
    run = write_run(store.parent / "trace", "t", num_requests=5, seed=4)
    src = DataSource(store.parent / "trace")
    rid = int(run.request_ids[2])
    trace = src.request_trace("t", str(rid))
    assert set(trace.spans[col.REQUEST_ID]) == {rid}
    assert len(trace.tokens) == 2 * int(run.num_output_tokens[2])  # engine and client rows
    with pytest.raises(StoreError, match="is not a request id"):
        src.request_trace("t", "12; rm -rf /")
    with pytest.raises(StoreError, match="is not in run"):
        src.request_trace("t", "123")


def test_downsample_keeps_extremes_and_bounds_points():
    x = np.arange(100_000)
    y = np.zeros(100_000)
    y[54_321] = 99.0  # a spike must survive
    frame = pd.DataFrame({"t": x, "v": y})
    out = downsample(frame, "t", max_points=500)
    assert len(out) <= 502
    assert out["v"].max() == 99.0
    assert out["t"].is_monotonic_increasing
    short = frame.head(10)
    assert downsample(short, "t") is short


@pytest.mark.parametrize(("seconds", "window"), [(5, 1), (600, 5), (3600, 30), (10**6, 3600)])
def test_series_window_comes_from_a_fixed_ladder(seconds, window):
    assert series_window_s(seconds * 10**9) == window


def test_first_analysis_of_a_finished_run_derives_its_facts(tmp_path):
    from analyzers.derivation import FACTS
    from tokentrace.store.derived import DERIVED_DIR

    write_run(tmp_path, "r", num_requests=30, seed=3)
    first = DataSource(tmp_path).result("r", RunAnalysis.stage_breakdown)
    facts = [p for p in (tmp_path / "r" / DERIVED_DIR).glob("*.parquet") if not p.name.startswith(".")]  # not a snapshot
    assert sorted(p.stem for p in facts) == sorted(f.name for f in FACTS)  # beside each: its digest, readers' snapshots
    again = DataSource(tmp_path).result("r", RunAnalysis.stage_breakdown)  # a fresh process state reads the facts
    pd.testing.assert_frame_equal(first, again, check_exact=False, rtol=1e-12)


def test_a_store_where_facts_cannot_be_written_is_analyzed_from_its_parts(tmp_path):
    from tokentrace.store.derived import DERIVED_DIR

    write_run(tmp_path, "r", num_requests=30, seed=3)
    (tmp_path / "r" / DERIVED_DIR).write_text("a file where the folder would go")  # every write fails
    lat = DataSource(tmp_path).result("r", RunAnalysis.latency)
    assert int(lat.loc[lat["metric"] == "ttft", "count"].iloc[0]) == 30


def test_analyses_are_called_not_named(store):
    src = DataSource(store)
    with pytest.raises(TypeError, match="RunAnalysis method"):
        src.result("one", "latency")  # a name string is refused: the analysis is the method itself
    cdf = src.result("one", RunAnalysis.capacity_cdf)  # capacity is part of RunAnalysis
    assert src.result("one", RunAnalysis.capacity_cdf) is cdf and set(cdf["metric"]) >= {"ttft", "itl"}
    warm = warm_calls(src.info("one"))
    assert all(callable(analysis) for analysis, _ in warm)
    assert RunAnalysis.capacity_load_latency in [analysis for analysis, _ in warm]


def test_warming_computes_every_analysis_the_overview_asks_for(store):
    from dashboard.app import create_app
    from dashboard.components.shell import ViewQuery

    create_app(store)  # registers the pages
    from dashboard.pages import overview

    asked: list[tuple[str, tuple]] = []

    class Recording(DataSource):
        def result(self, run_id, analysis, **kwargs):
            asked.append((analysis.__qualname__, tuple(sorted(kwargs.items()))))
            return super().result(run_id, analysis, **kwargs)

    src = Recording(store)
    overview.body(src, ViewQuery(run="one"))
    warm = {(analysis.__qualname__, tuple(sorted(kwargs.items()))) for analysis, kwargs in warm_calls(src.info("one"))}
    assert asked and [call for call in asked if call not in warm] == []


def test_compare_reads_the_runs_against_run_to_run_noise(store):
    src = DataSource(store)
    df = src.compare("two", "one")
    assert src.compare("two", "one") is df
    assert {"verdict", "min_detectable", "noise_source"} <= set(df.columns)
    assert (df["runs_baseline"].dropna() <= 1).all()
