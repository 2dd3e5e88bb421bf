"""Budget files: both TOML forms, units, bad input, and pass/fail against metrics and a baseline."""

from __future__ import annotations

import math

import pytest

from tokentrace.app.report.budget import (
    BudgetError,
    Change,
    MetricKind,
    evaluate,
    format_value,
    load_budgets,
    metric_kind,
    parse_budget,
    parse_budgets,
)

TABLE_FORM = """
[budgets]
"ttft.p99" = "<= 800ms"
"itl.p50" = "<= 50ms"
"stage.schedule.queue.share_of_ttft" = "<= 0.3"
"unattributed.share" = "<= 0.01"
"slo.interactive.attainment" = ">= 0.9"
"regression.itl.p99" = "<= +5%"
"""


def test_table_form_parses_every_example_of_the_issue(tmp_path):
    path = tmp_path / "tokentrace.toml"
    path.write_text(TABLE_FORM)
    budgets = load_budgets(path)
    assert [b.metric for b in budgets] == ["ttft.p99", "itl.p50", "stage.schedule.queue.share_of_ttft",
                                           "unattributed.share", "slo.interactive.attainment", "regression.itl.p99"]
    assert [(b.op, b.limit, b.kind) for b in budgets] == [
        ("<=", 800.0, MetricKind.TIME), ("<=", 50.0, MetricKind.TIME), ("<=", 0.3, MetricKind.RATIO),
        ("<=", 0.01, MetricKind.RATIO), (">=", 0.9, MetricKind.RATIO), ("<=", pytest.approx(0.05), MetricKind.RELATIVE)]
    assert budgets[-1].is_regression and budgets[-1].base_metric == "itl.p99"


def test_list_form_and_units(tmp_path):
    budgets = parse_budgets({"budgets": ["ttft.p99 <= 0.8s", "itl.p99<2500us", "e2e.p99.9 < 3000000ns",
                                         "slo.batch.attainment >= 95%", "regression.ttft.p50 <= +10ms",
                                         "counters.dropped <= 0", "goodput.rps >= 1.5"]})
    limits = {b.metric: (b.limit, b.kind) for b in budgets}
    assert limits["ttft.p99"] == (pytest.approx(800.0), MetricKind.TIME)
    assert limits["itl.p99"] == (pytest.approx(2.5), MetricKind.TIME)
    assert limits["e2e.p99.9"] == (pytest.approx(3.0), MetricKind.TIME)
    assert limits["slo.batch.attainment"] == (pytest.approx(0.95), MetricKind.RATIO)
    assert limits["regression.ttft.p50"] == (pytest.approx(10.0), MetricKind.DELTA_TIME)
    assert limits["counters.dropped"] == (0.0, MetricKind.COUNT)
    assert limits["goodput.rps"] == (1.5, MetricKind.RATE)


@pytest.mark.parametrize("metric,limit,fragment", [
    ("ttft.p98", "<= 1ms", "valid metrics"),
    ("stage.schedule.wait.share_of_ttft", "<= 0.3", "unknown stage 'schedule.wait'"),
    ("ttft.p99", "<= 800", "needs a unit"),
    ("ttft.p99", "800ms", "cannot read limit"),
    ("ttft.p99", "<= 8 parsecs", "cannot read limit"),
    ("unattributed.share", "<= 10ms", "only fits a time metric"),
    ("goodput.rps", ">= 50%", "percentage only fits a ratio"),
])
def test_bad_entries_raise_one_sentence(metric, limit, fragment):
    with pytest.raises(BudgetError, match=fragment) as info:
        parse_budget(metric, limit, source="budget file x.toml")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text,fragment", [
    ("[budgets\n", "not valid TOML"),
    ("title = 'no budgets here'\n", "has no budgets"),
    ("budgets = 3\n", "must be a table or a list"),
    ("budgets = [3]\n", "must be a string"),
    ("budgets = ['ttft.p99 is small']\n", "cannot read budget"),
    ("[budgets]\nttft.p99 = '<= 1ms'\n", "quote dotted metric names"),
    ("[budgets]\n'ttft.p99' = 800\n", "must be a string"),
])
def test_malformed_files(tmp_path, text, fragment):
    path = tmp_path / "b.toml"
    path.write_text(text)
    with pytest.raises(BudgetError, match=fragment):
        load_budgets(path)


def test_missing_file():
    with pytest.raises(BudgetError, match="does not exist"):
        load_budgets("/nonexistent/tokentrace.toml")


def test_metric_kind_lists_valid_patterns_for_unknown_names():
    with pytest.raises(BudgetError) as info:
        metric_kind("latency.p99")
    assert "ttft" in str(info.value) and "stage.<stage>" in str(info.value) and "regression." in str(info.value)


METRICS = {"ttft.p99": 900.0, "itl.p50": 40.0, "unattributed.share": 0.002, "slo.interactive.attainment": 0.85,
           "stage.schedule.queue.share_of_ttft": float("nan")}


def test_evaluate_pass_fail_and_not_measured():
    budgets = parse_budgets({"budgets": ["ttft.p99 <= 800ms", "itl.p50 <= 50ms", "unattributed.share <= 0.01",
                                         "slo.interactive.attainment >= 0.9",
                                         "stage.schedule.queue.share_of_ttft <= 0.3", "tpot.p99 <= 1s"]})
    results = evaluate(budgets, METRICS)
    assert [r.passed for r in results] == [False, True, True, False, False, False]
    assert results[0].message == "ttft.p99 = 900.0 ms violates limit <= 800.0 ms"
    assert results[1].actual == 40.0
    assert "not measured" in results[4].message and "not measured" in results[5].message


def test_regression_budgets_need_a_baseline_and_respect_significance():
    budgets = parse_budgets({"budgets": ["regression.itl.p99 <= +5%", "regression.ttft.p99 <= +5%",
                                         "regression.e2e.p50 <= +1ms"]})
    with pytest.raises(BudgetError, match="--baseline"):
        evaluate(budgets, {"itl.p99": 1.0})
    changes = {"itl.p99": Change(10.0, 20.0, significant=True),  # +100%, real: fails
               "ttft.p99": Change(10.0, 20.0, significant=False),  # +100%, noise: passes
               "e2e.p50": Change(100.0, 100.5)}  # +0.5 ms: within
    results = evaluate(budgets, {}, changes)
    assert [r.passed for r in results] == [False, True, True]
    assert results[0].actual == pytest.approx(1.0) and results[0].baseline == 10.0
    assert "baseline 10.0 ms" in results[0].message
    assert "not significant" in results[1].message
    assert results[2].actual == pytest.approx(0.5)


def test_relative_change_from_zero_baseline():
    (b,) = parse_budgets({"budgets": ["regression.counters.dropped <= 10%"]})
    (r,) = evaluate([b], {}, {"counters.dropped": Change(0.0, 5.0)})
    assert not r.passed and math.isinf(r.actual)


def test_format_value():
    assert format_value(812.44, MetricKind.TIME) == "812.4 ms"
    assert format_value(0.05, MetricKind.RELATIVE) == "+5.0%"
    assert format_value(float("nan"), MetricKind.RATIO) == "not measured"
    assert format_value(2.0, MetricKind.DELTA_TIME) == "+2.000 ms"
