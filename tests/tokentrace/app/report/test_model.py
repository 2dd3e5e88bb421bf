"""The report's data gathered from real and hand-made runs: sections, metrics, diff, budgets."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokentrace.app.report import make_report
from tokentrace.app.report.budget import BudgetError, parse_budgets
from tokentrace.app.report.inputs import ReportInputError, open_checked, split_run_ref
from tokentrace.app.report.model import build_report
from tokentrace.schema import REQUESTS, SPANS, Stage

SECTION_KEYS = ["load", "latency", "slo", "stage_breakdown", "loop_lag", "slowest_requests", "queues", "cache", "pd_ratio", "batch",
                "speculative", "sessions",
                "tenants", "agreement", "whatif", "diff", "counters"]


@pytest.fixture(scope="module")
def engine_report(engine_store):
    return make_report(engine_store)


def test_real_run_fills_every_section_it_has_data_for(engine_report):
    report = engine_report
    assert [s.key for s in report.sections] == SECTION_KEYS
    for key in ("latency", "slo", "stage_breakdown", "slowest_requests", "queues", "pd_ratio", "batch", "tenants"):
        assert report.section(key).tables, key
    (_, latency), = report.section("latency").tables
    assert list(latency["metric"]) == ["ttft", "tpot", "itl", "e2e"]
    assert latency.set_index("metric").loc["itl", "count"] == 8 * 5  # 8 requests, tokens 1..5
    assert "no client-side" in report.section("agreement").note
    assert report.section("loop_lag").note.startswith("No event loop was sampled")  # an engine-only run
    assert report.section("diff").note.startswith("No baseline run")
    assert report.baseline is None and report.diff is None and report.passed


def test_metrics_namespace_matches_the_analyzers(engine_report):
    m = engine_report.metrics
    (_, latency), = engine_report.section("latency").tables
    assert m["ttft.p99"] == pytest.approx(latency.set_index("metric").loc["ttft", "p99_ms"])
    assert m["ttft.p50"] <= m["ttft.p90"] <= m["ttft.p99"] <= m["ttft.p99.9"]
    assert abs(m["unattributed.share"]) < 0.01  # the attribution invariant on the reference engine: signed,
    assert 0 <= m["overlap.share"] < 0.01  # and the double-counted time apart
    ttft_shares = sum(m[f"stage.{s.label}.share_of_ttft"] for s in Stage) + m["stage.unattributed.share_of_ttft"]
    assert ttft_shares == pytest.approx(1.0)
    assert m[f"stage.{Stage.PREFILL_COMPUTE.label}.share_of_ttft"] > 0
    assert {"slo.interactive.attainment", "slo.batch.attainment", "slo.all.attainment", "goodput.rps"} <= set(m)
    assert m["counters.dropped"] == 0


def test_charts_carry_latency_breakdown_and_queue_series(engine_report):
    charts = engine_report.charts
    assert len(charts.latency) == 4 and len(charts.breakdown) > 0 and len(charts.queues) > 0
    assert (charts.breakdown[["ttft_share", "itl_share"]].sum() > 0.99).all()


def test_budgets_checked_against_the_run(engine_store, engine_report):
    ttft_p99 = engine_report.metrics["ttft.p99"]
    budgets = parse_budgets({"budgets": [f"ttft.p99 <= {ttft_p99 * 2:.6f}ms", f"ttft.p99 < {ttft_p99 / 2:.6f}ms",
                                         "unattributed.share <= 1%", "slo.nosuchclass.attainment >= 0.5"]})
    report = make_report(engine_store, budgets=budgets)
    assert [r.passed for r in report.budgets] == [True, False, True, False]
    assert "not measured" in report.budgets[3].message and not report.passed


def test_agreement_section_compares_with_the_client(client_store):
    report = make_report(client_store)
    (_, latency), = report.section("latency").tables
    assert latency.set_index("metric").loc["ttft", "count"] == 30  # the server's view only
    (_, agreement), = report.section("agreement").tables
    rows = agreement.set_index("metric")
    assert rows.loc["ttft", "mean_ms"] == pytest.approx(-1.5)  # 1 ms earlier send + 0.5 ms later receipt
    assert rows.loc["itl", "mean_ms"] == pytest.approx(0.0, abs=1e-9)


def test_sections_degrade_to_a_sentence_without_their_tables(bare_store):
    report = make_report(bare_store)
    assert report.section("latency").tables  # requests and tokens are there
    for key in ("stage_breakdown", "queues", "pd_ratio", "batch"):
        section = report.section(key)
        assert not section.tables and section.note.startswith("Not available: the run has no"), key
    assert "spans" in report.section("stage_breakdown").note and "steps" in report.section("queues").note
    assert len(report.charts.breakdown) == 0 and len(report.charts.queues) == 0


def test_planted_regression_is_flagged_and_gates(planted_stores, aa_store):
    base, cand = planted_stores
    budgets = parse_budgets({"budgets": ["regression.itl.p99 <= +5%", "regression.ttft.p99 <= +5%"]})
    report = make_report(cand, baseline=str(base), budgets=budgets, noise=f"{aa_store}:*")
    assert report.baseline.run_id == "base"
    flagged = report.diff[report.diff["regression"]]
    assert {("itl", "p99"), ("itl", "mean")} <= set(zip(flagged["metric"], flagged["statistic"]))
    assert not ((report.diff["metric"] == "ttft") & report.diff["regression"]).any()  # TTFT did not change
    assert any(r.startswith("itl p99") for r in report.regressions)
    itl, ttft = report.budgets
    assert not itl.passed and itl.actual == pytest.approx(0.9, abs=0.15)  # ~2x decode time, +0.5 ms queue
    assert ttft.passed and ttft.actual == pytest.approx(0.0, abs=1e-9)
    note = report.section("diff").note
    assert "significant" in note and report.section("diff").tables
    assert "3 A/A runs in" in note and "1 / 1 run(s)" in note


def test_one_run_per_side_with_the_default_noise_says_what_it_cannot_tell(planted_stores):
    base, cand = planted_stores
    report = make_report(cand, baseline=str(base))  # +100% ITL, one run per side, the documented noise figure
    note = report.section("diff").note
    assert "default: A/A runs of the reference server" in note and "smallest change detected" in note
    itl = report.diff.set_index(["metric", "statistic"]).loc[("itl", "mean")]
    assert itl["verdict"] == "noise" and itl["min_detectable"] > itl["rel_change"] > 0.8
    assert itl["runs_needed"] >= 2
    captions = [c for c, _ in report.section("diff").tables]
    assert "Not distinguishable from run-to-run noise (changes of 10% or more)" in captions


def test_several_runs_per_side_measure_their_own_noise(aa_store, candidate_runs):
    cands = candidate_runs
    report = make_report(cands, "c-1", baseline=[f"{aa_store}:*", str(aa_store)], candidates=[f"{cands}:c-*"],
                         noise=f"{aa_store}:*")
    row = report.diff.set_index(["metric", "statistic"]).loc[("stage.decode.compute.itl", "mean")]
    assert row["runs_baseline"] == 3 and row["runs_candidate"] == 3  # each run counted once however named
    assert row["regression"] and row["noise_source"].startswith("measured: the spread of these 3 + 3 runs, "
                                                                "steadied by this row's figure from 3 A/A runs in")
    assert not report.diff[report.diff["metric"].str.startswith("ttft")]["significant"].any()
    # without A/A runs of this machine, the documented figure (60% for this row) steadies it: three runs a side
    # cannot tell +100% from noise, and the report says how many would
    default = make_report(cands, "c-1", baseline=f"{aa_store}:*", candidates=[f"{cands}:c-*"])
    row = default.diff.set_index(["metric", "statistic"]).loc[("stage.decode.compute.itl", "mean")]
    assert row["verdict"] == "noise" and row["min_detectable"] > row["rel_change"] and 3 < row["runs_needed"] < 50


def test_a_run_against_itself_flags_nothing(planted_stores):
    base, _ = planted_stores
    budgets = parse_budgets({"budgets": ["regression.itl.p99 <= +5%"]})
    report = make_report(base, baseline=f"{base}:base", budgets=budgets)
    assert report.regressions == () and not report.diff["significant"].any()
    assert report.passed and report.budgets[0].actual == 0.0


def test_regression_budget_without_baseline_is_bad_input_before_any_analysis(tmp_path):
    budgets = parse_budgets({"budgets": ["regression.itl.p99 <= +5%"]})
    with pytest.raises(BudgetError, match="--baseline"):
        make_report(tmp_path / "not-even-a-store", budgets=budgets)
    with pytest.raises(BudgetError, match="--baseline"):
        build_report(object(), {}, budgets=budgets)


def test_a_store_of_the_older_schema_is_reported():
    report = make_report(Path(__file__).resolve().parents[3] / "data" / "store_v0")
    assert report.run.run_id == "v0-fixture" and report.run.tokentrace_version == "0.0.1"
    (_, latency), = report.section("latency").tables
    assert latency.set_index("metric").loc["ttft", "count"] == 1  # one of its two requests got a token
    assert report.section("queues").note == "Not available: the run has no steps rows."


def test_run_refs_and_required_tables(bare_store):
    assert split_run_ref(str(bare_store)) == (bare_store, None)
    assert split_run_ref("stores/main:run-1") == (Path("stores/main"), "run-1")
    with pytest.raises(ReportInputError):
        split_run_ref("stores/main:")
    run, rows = open_checked(bare_store)
    assert run.run_id == "bare" and rows[REQUESTS.name] == 30
    with pytest.raises(ReportInputError, match="no spans rows"):
        open_checked(bare_store, required=(SPANS.name,))
