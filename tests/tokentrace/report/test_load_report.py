"""What the report says first and what it refuses to guess, on simulated runs with a known truth.

* an overloaded run (arrivals at 2.25x the decode pool's capacity): the first lines say
  saturated, name the decode pool and ask for more decode instances; the JSON report
  carries ``load.offered_rps``, ``load.served_rps`` and ``load.saturated``;
* a lightly loaded run: not saturated, nothing more asked for;
* a run without per-token data: TPOT and SLO attainment are "not measured" (null in
  JSON, a sentence in text) and a budget on them exits 2 saying so;
* a run with errors: the failed requests are said to count as not good;
* every stage is in the breakdown, or named among the ones under 0.01%.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.append(str(Path(__file__).resolve().parents[2] / "analyzers"))  # the simulated-run helpers

from handmade import HandMade  # noqa: E402
from simulated import simulate  # noqa: E402

from tokentrace.cli import app, register_commands  # noqa: E402
from tokentrace.report import make_report, render  # noqa: E402
from tokentrace.report.sections import hidden_stages  # noqa: E402
from tokentrace.schema import UNATTRIBUTED_LABEL, RequestStatus, Stage  # noqa: E402

register_commands()
runner = CliRunner()
DECODE_RPS = 1000 / (9 * 50.0)  # one decode instance: 9 decode tokens of 50 ms per request


def _store(tmp_path_factory, name: str, rate_rps: float, seconds: float, **kw) -> Path:
    h = HandMade()
    simulate(h, [i * 1000.0 / rate_rps for i in range(int(rate_rps * seconds))], decode_step_ms=50.0, **kw)
    return h.write(tmp_path_factory.mktemp(name), run_id=name)


@pytest.fixture(scope="module")
def overloaded(tmp_path_factory) -> Path:
    return _store(tmp_path_factory, "overloaded", 2.25 * DECODE_RPS, 20)


@pytest.fixture(scope="module")
def light(tmp_path_factory) -> Path:
    return _store(tmp_path_factory, "light", 0.4 * DECODE_RPS, 20)


@pytest.fixture(scope="module")
def no_tokens(tmp_path_factory) -> Path:
    return _store(tmp_path_factory, "no-tokens", 1.0, 15, per_token=False)


def test_the_first_lines_say_saturated_and_name_the_pool(overloaded):
    result = runner.invoke(app, ["report", str(overloaded), "--format", "md"])
    assert result.exit_code == 0, result.output
    first, _, verdict, _, advice = result.stdout.splitlines()[:5]
    assert first == "# tokentrace report: run `overloaded`"
    assert verdict.startswith("**SATURATED: arrivals outran service, offered 5.00 req/s")
    assert "The decode pool saturates" in verdict and "decode.queue" in verdict
    assert "decode 3 (75% busy; has 1)" in advice and "lacks 2 decode instance(s)" in advice
    assert "prefill 1" in advice and "P:D = 1:3" in advice


def test_the_json_report_carries_the_load_verdict(overloaded):
    doc = json.loads(render(make_report(overloaded), "json"))
    load = doc["load"]
    assert load["offered_rps"] == pytest.approx(5.0, rel=0.01)
    assert load["served_rps"] == pytest.approx(DECODE_RPS, rel=0.02)
    assert load["saturated"] is True and load["pool"] == "decode" and load["stage"] == "decode.queue"
    assert doc["headline"][0] == load["verdict"]
    advice = {r["pool"]: r for r in doc["sections"]["pd_ratio"]["tables"][0]["rows"]}
    assert advice["decode"]["instances"] == 3 and advice["decode"]["lacks"] == 2
    assert advice["prefill"]["lacks"] == 0


def test_a_light_run_is_neither_saturated_nor_short_of_instances(light):
    report = make_report(light)
    assert report.load["saturated"] is False and report.load["pool"] is None
    verdict, advice = report.headline[:2]
    assert verdict.startswith("Not saturated") and "SATURATED" not in verdict
    assert "has enough instances" in advice and "lacks" not in advice


def test_what_was_not_measured_is_null_and_said(no_tokens):
    report = make_report(no_tokens)
    doc = json.loads(render(report, "json"))
    assert doc["metrics"]["slo.all.attainment"] is None and doc["metrics"]["goodput.rps"] is None
    assert doc["metrics"]["slo.all.fluidity"] is None
    note = report.section("slo").note
    assert "TPOT attainment, and so SLO attainment and goodput, were not measured" in note
    assert "not measured" in render(report, "md")


def test_a_budget_on_a_metric_not_measured_exits_2_saying_so(no_tokens, tmp_path):
    budget = tmp_path / "budget.toml"
    budget.write_text('budgets = ["slo.all.attainment >= 0.85", "ttft.p99 <= 10s"]\n')
    result = runner.invoke(app, ["report", str(no_tokens), "--budget", str(budget), "--format", "junit",
                                 "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "error: budget 'slo.all.attainment >= 0.85' cannot be checked: slo.all.attainment was not measured" \
        in result.stderr
    assert (tmp_path / "out" / "junit.xml").is_file()  # the reports are written first
    assert "Traceback" not in result.output


def test_failed_requests_are_said_not_to_count(tmp_path_factory):
    statuses = [int(RequestStatus.ERROR) if i % 5 == 0 else int(RequestStatus.OK) for i in range(15)]
    store = _store(tmp_path_factory, "errors", 1.0, 15, statuses=statuses)
    report = make_report(store)
    assert "3 of 15 requests failed" in report.section("slo").note
    assert report.metrics["slo.all.attainment"] == pytest.approx(12 / 15)


def test_every_stage_is_listed_or_named_as_under_a_hundredth_of_a_percent(overloaded):
    report = make_report(overloaded)
    section = report.section("stage_breakdown")
    shown = set(section.tables[0][1]["stage"])
    hidden = [s.label for s in Stage if s.label not in shown]
    assert hidden and f"{len(hidden)} stage(s) under 0.01% of every column not shown: {', '.join(hidden)}." \
        in section.note
    assert UNATTRIBUTED_LABEL in shown
    full = make_report(overloaded).charts.breakdown
    assert set(full["stage"]) == shown and hidden_stages(full) == []
