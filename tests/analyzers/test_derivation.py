"""Derived facts (analyzers.derivation, analyzers.facts): every analysis gives the same answer from them as from
the part files, on a multi-process run with clock offsets, on the real run and on a version-0 store; stale or
missing facts leave the part files as the only source."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from handmade import HandMade
from simulated import simulate

from analyzers import capacity, facts
from analyzers.analysis import RunAnalysis
from analyzers.derivation import FACTS, derive
from analyzers.facts import format_key
from analyzers.source import Source
from analyzers.spec_rows import SPEC_DECODE_TOKENS, SPEC_STEP_ROWS
from analyzers.stage_breakdown import stage_column
from analyzers.timing import TOKEN_TIMES
from tokentrace.clock import time_columns
from tokentrace.schema import TABLES, Role, Stage, col
from tokentrace.store.derived import DERIVED_DIR, read_derived
from tokentrace.store.layout import part_name, partition_dir
from tokentrace.store.reader import open_run

DATA = Path(__file__).resolve().parents[1] / "data"

CALLS: list[tuple[str, dict]] = [
    ("load", {}), ("latency", {}), ("latency", {"by": "tenant"}), ("latency", {"window_s": 0.5}), ("slo", {}),
    ("goodput", {}), ("fluidity", {}), ("pd_ratio", {}), ("attribution", {}), ("stage_breakdown", {}),
    ("stage_breakdown", {"by": "tenant"}), ("stage_breakdown", {"by": "instance"}),
    ("stage_breakdown", {"window_s": 0.5}), ("critical_path", {}), ("slowest_requests", {"n": 25}),
    ("queues", {}), ("cache", {}), ("batch", {}), ("interference", {}), ("tenants", {}),
    ("unattributed_share", {}), ("overlap_share", {}),
]
CAPACITY: list[tuple[str, dict]] = [
    ("throughput_summary", {}), ("percentiles", {}), ("throughput", {"window_s": 0.5}),
    ("load_latency", {"window_s": 0.5}), ("cdf", {}), ("ttft_by_prompt", {}),
]
NAMES = [fact.name for fact in FACTS]
OFFSETS_MS = {1: 0.0, 2: 250.0, 101: -120.0, 102: 37.5}  # instance -> clock offset to the reference clock


def _answers(analysis: RunAnalysis) -> dict[str, object]:
    out: dict[str, object] = {f"{m}{kw}": getattr(analysis, m)(**kw) for m, kw in CALLS}
    for fn, kw in CAPACITY:
        out[f"capacity.{fn}{kw}"] = getattr(capacity, fn)(analysis.source, **kw)
    return out


def _assert_same(a: object, b: object, where: str) -> None:
    """Equal: integers and labels exactly, floats to 1e-12 (the engine's parallel sums are not bit-stable)."""
    if isinstance(a, pd.DataFrame):
        assert isinstance(b, pd.DataFrame), where
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-12, atol=0, obj=where)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-12, abs=0), where
    else:
        assert a == b, where


def _offsets_run(root: Path) -> Path:
    """A simulated disaggregated run (2 prefill, 2 decode instances) whose processes each recorded on their own
    clock: every time column of an instance's rows is moved to ``t_ref - offset`` and the offset stored."""
    h = HandMade()
    rng = np.random.default_rng(7)
    arrivals = np.cumsum(rng.exponential(40.0, 60)).tolist()
    simulate(h, arrivals, mode="disagg", num_prefill=2, num_decode=2, output=6, decode_step_ms=8.0,
             cached=[int(x) for x in rng.choice([0, 32, 64], 60)], tenants=[("a", "b", "c")[i % 3] for i in range(60)],
             classes=[("interactive", "batch")[i % 2] for i in range(60)])
    for row in h.rows["instances"]:
        row[col.CLOCK_OFFSET_NS] = int(OFFSETS_MS[row[col.INSTANCE_ID]] * 1e6)
    for name in TABLES:
        for row in h.rows[name]:
            shift = int(OFFSETS_MS.get(row.get(col.INSTANCE_ID), 0.0) * 1e6)
            for c in time_columns(name):
                if row.get(c) is not None:
                    row[c] -= shift
    h.write(root, "offsets")
    return root / "offsets"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("derivation")
    shutil.copytree(DATA / "real_run", root / "real")
    shutil.copytree(DATA / "store_v0", root / "v0")
    return {"offsets": _offsets_run(root / "sim"), "real": root / "real" / "mooncake-disagg",
            "v0": root / "v0" / "v0-fixture"}


@pytest.mark.parametrize("name", ["offsets", "real", "v0"])
def test_every_answer_is_the_same_from_the_derived_facts(runs: dict[str, Path], name: str) -> None:
    path = runs[name]
    run = open_run(path.parent, path.name)
    shutil.rmtree(path / DERIVED_DIR, ignore_errors=True)
    plain = RunAnalysis(run)
    assert not facts.is_saved(plain.source, TOKEN_TIMES)  # nothing derived yet: the part files
    from_parts = _answers(plain)
    assert derive(run) == NAMES
    assert derive(run) == []  # all current: nothing to do
    derived = RunAnalysis(run)
    assert all(facts.is_saved(derived.source, f) for f in FACTS)
    from_facts = _answers(derived)
    for key, value in from_parts.items():
        _assert_same(value, from_facts[key], f"{name}: {key}")


def test_clock_offsets_are_applied_before_deriving(runs: dict[str, Path]) -> None:
    """The offsets run's token 1 starts when the prefill instance (clock +250 ms) delivered token 0 and ends when
    a decode instance delivered it: with the offsets undone its latency is one decode step plus the wait."""
    path = runs["offsets"]
    derive(open_run(path.parent, path.name))
    times = pq.read_table(path / DERIVED_DIR / "token_times.parquet").to_pandas()
    assert (times["latency_ns"] > 0).all()  # a wrong offset (250 ms apart) would make some intervals negative
    stages = pq.read_table(path / DERIVED_DIR / "token_stage_ns.parquet").to_pandas()
    compute = stages[stage_column(Stage.DECODE_COMPUTE)]
    assert set(compute[stages[col.TOKEN_INDEX] > 0].unique()) == {8_000_000}  # one 8 ms step per decode token


def test_a_new_part_makes_the_facts_stale(runs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copytree(runs["offsets"], tmp_path / "offsets")
    path = tmp_path / "offsets"
    run = open_run(tmp_path, "offsets")
    derive(run)
    before = RunAnalysis(run).latency()
    h = HandMade()  # one more request, recorded by a late writer
    h.instance(1, Role.PREFILL)
    h.request(9999, 100.0, 200.0)
    h.tokens(9999, [150.0, 190.0])
    folder = partition_dir(path, "requests", 7)
    folder.mkdir(parents=True)
    pq.write_table(h.table("requests"), folder / part_name(1))
    folder = partition_dir(path, "tokens", 7)
    folder.mkdir(parents=True)
    pq.write_table(h.table("tokens"), folder / part_name(1))
    after = RunAnalysis(run)
    assert not facts.is_saved(after.source, TOKEN_TIMES)  # stale: not read
    lat = after.latency().set_index("metric")
    assert lat.loc["ttft", "count"] == before.set_index("metric").loc["ttft", "count"] + 1
    assert derive(run) == NAMES  # derived afresh for the new parts
    _assert_same(lat.reset_index(), RunAnalysis(run).latency(), "after re-deriving")


def test_facts_of_another_format_are_not_read(runs: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    shutil.copytree(runs["offsets"], tmp_path / "offsets")
    run = open_run(tmp_path, "offsets")
    derive(run)
    monkeypatch.setattr(facts, "FORMAT_VERSION", facts.FORMAT_VERSION + 1)  # code that derives something else
    assert not facts.is_saved(RunAnalysis(run).source, TOKEN_TIMES)
    assert derive(run) == NAMES


def test_a_run_is_finished_when_every_writer_closed(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dashboard"))
    from synthetic_store import write_run

    from tokentrace.store.manifest import read_fragments

    write_run(tmp_path, "done", num_requests=5)
    assert open_run(tmp_path, "done").is_finished()
    fragment = read_fragments(tmp_path / "done")
    assert fragment and all(f.get("closed") for f in fragment)
    HandMade().write(tmp_path, "no-writers")  # no writer fragments at all (written outside tokentrace)
    assert not open_run(tmp_path, "no-writers").is_finished()


def test_read_derived_keeps_only_current_files(runs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copytree(runs["offsets"], tmp_path / "offsets")
    path = tmp_path / "offsets"
    derive(open_run(tmp_path, "offsets"))
    (path / DERIVED_DIR / "junk.parquet").write_bytes(b"not parquet")
    current = read_derived(path, "0" * 64, format_key())
    assert current == {}  # another fingerprint


@pytest.mark.parametrize(("values", "levels", "expected"), [
    ([1.0, 2.0, 3.0, 4.0], [0.0, 0.5, 1.0], [1.0, 2.5, 4.0]),  # rn = 1.5 -> halfway between 2 and 3
    ([10.0, 20.0], [0.25], [12.5]),
    ([5.0], [0.0, 0.3, 1.0], [5.0, 5.0, 5.0]),
])
def test_interpolated_quantiles(values: list[float], levels: list[float], expected: list[float]) -> None:
    assert capacity.interpolated_quantiles(np.array(values), levels) == expected


def test_the_engine_draws_no_progress_bar_of_its_own(runs: dict[str, Path], tmp_path: Path) -> None:
    # Deriving a big run takes seconds per query: DuckDB's own progress bar would be drawn on the terminal of
    # `tokentrace run` (and in the dashboard's log), beside the lines tokentrace prints.
    shutil.copytree(runs["offsets"], tmp_path / "offsets")
    src = RunAnalysis(open_run(tmp_path, "offsets")).source
    assert src.scalar("SELECT current_setting('enable_progress_bar')") is False


def test_sessions_speculation_and_diff_are_the_same_from_the_derived_facts(tmp_path: Path) -> None:
    """On synthetic runs with multi-turn sessions and speculative steps (their facts: spec_step_rows,
    spec_decode_tokens), and a diff against a run without either, computed twice (its bootstrap draws from
    the samples in one order, whatever order the engine returns rows in)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dashboard"))
    from synthetic_store import write_run

    write_run(tmp_path, "plain", num_requests=300, mean_output_tokens=4.0, rate_rps=500.0)
    write_run(tmp_path, "both", num_requests=3000, mean_output_tokens=4.0, rate_rps=500.0, sessions=0.3,
              speculative=True)
    plain = {r: RunAnalysis(open_run(tmp_path, r)) for r in ("plain", "both")}
    assert not facts.is_saved(plain["both"].source, SPEC_STEP_ROWS)
    again = RunAnalysis(open_run(tmp_path, "both")).diff(RunAnalysis(open_run(tmp_path, "plain")))
    from_parts = {"sessions": plain["both"].sessions(), "speculation": plain["both"].speculation(),
                  "diff": plain["both"].diff(plain["plain"])}
    for run_id in ("plain", "both"):
        assert derive(open_run(tmp_path, run_id)) == NAMES
    derived = {r: RunAnalysis(open_run(tmp_path, r)) for r in ("plain", "both")}
    assert facts.is_saved(derived["both"].source, SPEC_DECODE_TOKENS)
    from_facts = {"sessions": derived["both"].sessions(), "speculation": derived["both"].speculation(),
                  "diff": derived["both"].diff(derived["plain"])}
    _assert_same(from_parts["diff"], again, "diff, computed twice")
    for key, value in from_parts.items():
        _assert_same(value, from_facts[key], key)
    assert not from_facts["sessions"].empty and not from_facts["speculation"].is_empty
    assert from_facts["diff"]["significant"].any()  # speculation and sessions moved ITL and TTFT


def fact_rows(src: Source, fact: facts.Fact) -> pd.DataFrame:
    """The fact's declared columns through the door, in a fixed order (every column, nulls last)."""
    frame = src.df(fact.rows_sql(facts.relation(src, fact)))
    lists = [c.name for c in fact.columns if str(c.type).startswith("list")]
    for name in lists:  # arrays compare as tuples
        frame[name] = [tuple(v) for v in frame[name]]
    return frame.sort_values(list(fact.names), na_position="last", kind="stable").reset_index(drop=True)


def assert_saved_equal_built(run_path: Path, engine: object = None) -> None:
    """Every fact of the registry read from the run's saved file equals the same fact built now from the part
    files (same columns, types and rows), on ``engine``."""
    run = open_run(run_path.parent, run_path.name)
    derive(run)
    saved = Source.of_run(run, engine=engine)
    built = Source.of_run(run, engine=engine)
    built._cache["saved_facts"] = {}  # this source builds every fact from the part files
    alone = Source.of_run(run, engine=engine)
    alone._cache["saved_facts"] = {}  # ... and this one only the rows asked for (rows_for), where it can
    try:
        for fact in FACTS:
            assert facts.is_saved(saved, fact) and not facts.is_saved(built, fact), fact.name
            a, b = fact_rows(saved, fact), fact_rows(built, fact)
            assert list(a.columns) == list(fact.names), fact.name
            _assert_same(a, b, f"{run_path.name}: {fact.name}")
            if fact.select_only is not None:
                _assert_some_rows_same(fact, a, saved, alone, f"{run_path.name}: {fact.name}")
            if fact.summary_along is not None:
                _assert_summary_along_same(fact, a, saved, run, engine, f"{run_path.name}: {fact.name}")
    finally:
        saved.close()
        built.close()
        alone.close()


def _assert_summary_along_same(fact: facts.Fact, rows: pd.DataFrame, saved: Source, run: object, engine: object,
                               where: str) -> None:
    """Summed in one pass with some rows of the fact it declares (:func:`analyzers.facts.summary_and_rows`), without
    the fact's rows: the summary is that of its saved rows (requests in three groups, and in one), and the other
    fact's rows are its saved rows for every third key."""
    other = fact.summary_along[0]
    saved_other = fact_rows(saved, other)
    some = saved_other[list(other.keys)].iloc[::3].drop_duplicates().reset_index(drop=True)
    expected = saved_other.merge(some, on=list(other.keys)).sort_values(list(other.names), kind="stable")
    assert len(some) and len(expected) == len(some), where
    requests = rows[[col.REQUEST_ID]].drop_duplicates().reset_index(drop=True)
    grouped = requests.assign(grp=requests[col.REQUEST_ID] % 3)
    for groups in (None, "some_groups"):
        along = Source.of_run(run, engine=engine)
        along._cache["saved_facts"] = {}
        try:
            for src in (along, saved):
                src.register("some_keys", some)
                src.register("some_groups", grouped)
            assert not facts.is_at_hand(along, fact) and not facts.is_at_hand(along, other), where
            summary, got_rows = facts.summary_and_rows(along, fact, groups, other, "some_keys")
            got = along.df(got_rows).sort_values(list(other.names), kind="stable").reset_index(drop=True)
            _assert_same(expected.reset_index(drop=True), got, f"{where}: rows of {other.name} along")
            assert not facts.is_at_hand(along, fact) and not facts.is_at_hand(along, other), where  # neither whole
            from_saved, _ = facts.summary_and_rows(saved, fact, groups, other, "some_keys")
            a, b = (s.df(f"SELECT * FROM {q} x").sort_values(["grp", col.STAGE]).reset_index(drop=True)
                    for s, q in ((saved, from_saved), (along, summary)))
            assert len(a) and list(a.columns) == list(b.columns), where
            _assert_same(a, b, f"{where}: summary of {fact.name} along {other.name} ({groups})")
        finally:
            saved.unregister("some_keys")
            saved.unregister("some_groups")
            along.close()


def _assert_some_rows_same(fact: facts.Fact, rows: pd.DataFrame, saved: Source, alone: Source, where: str) -> None:
    """Every third row's keys: their rows through :func:`analyzers.facts.rows_for` are the fact's rows for them,
    read from the saved file and built for those keys alone (the whole fact never built)."""
    some = rows[list(fact.keys)].iloc[::3].drop_duplicates().reset_index(drop=True)
    expected = rows.merge(some, on=list(fact.keys)).sort_values(list(fact.names), kind="stable")
    expected = expected.reset_index(drop=True)
    assert len(some) and len(expected) == len(some), where
    for src in (saved, alone):
        src.register("some_keys", some)
        got = src.df(facts.rows_for(src, fact, "some_keys")).sort_values(list(fact.names), kind="stable")
        src.unregister("some_keys")
        _assert_same(expected, got.reset_index(drop=True), f"{where}: rows_for")
    assert not facts.is_at_hand(alone, fact), where  # built for those keys only, not whole


@pytest.mark.parametrize("name", ["offsets", "real"])
def test_every_saved_fact_equals_the_fact_built_now(runs: dict[str, Path], name: str) -> None:
    assert_saved_equal_built(runs[name])


def test_every_saved_fact_of_a_speculative_run_equals_the_fact_built_now(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dashboard"))
    from synthetic_store import write_run

    write_run(tmp_path, "both", num_requests=300, mean_output_tokens=4.0, rate_rps=500.0, sessions=0.3,
              speculative=True)
    assert_saved_equal_built(tmp_path / "both")


def test_a_fact_is_declared_once() -> None:
    names = [fact.name for fact in FACTS]
    assert len(set(names)) == len(names)
    for fact in FACTS:
        assert len(set(fact.names)) == len(fact.names), fact.name


@pytest.mark.parametrize("name", ["offsets", "real"])
def test_a_breakdown_of_the_part_files_is_that_of_the_saved_facts(runs: dict[str, Path], name: str) -> None:
    """The breakdown of a run nothing derived facts for sums the spans per group in one pass (no per-request
    rows: the fact stays unbuilt) and gives what the saved per-request facts give, grouped or not."""
    from analyzers.stage_breakdown import REQUEST_STAGE_NS, breakdown

    run = open_run(runs[name].parent, runs[name].name)
    derive(run)
    for params in ({}, {"by": "tenant"}, {"by": "instance"}, {"window_s": 0.5}):
        saved, parts = Source.of_run(run), Source.of_run(run)
        parts._cache["saved_facts"] = {}
        try:
            assert facts.is_saved(saved, REQUEST_STAGE_NS)
            expected, got = breakdown(saved, **params), breakdown(parts, **params)
            assert not facts.is_at_hand(parts, REQUEST_STAGE_NS), params
            assert len(got) and not got.drop(columns="stage").isna().all().all(), params
            _assert_same(expected, got, f"{name}: breakdown {params}")
        finally:
            saved.close()
            parts.close()
