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
import math
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.append(str(Path(__file__).resolve().parents[3] / "analyzers"))  # the simulated-run helpers

from handmade import HandMade  # noqa: E402
from simulated import simulate  # noqa: E402

from tokentrace.app.cli import app, register_commands  # noqa: E402
from tokentrace.app.report import make_report, render  # noqa: E402
from tokentrace.app.report.sections import hidden_stages  # noqa: E402
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
    lines = [line for line in result.stdout.splitlines() if line]
    assert lines[0] == "# tokentrace report: run `overloaded`"
    assert lines[1].startswith("**SLO MISSED: "), lines[1]  # why before how loaded
    assert lines[2].startswith("Why #1: overload"), lines[2]
    verdict = next(line for line in lines if line.startswith("**SATURATED"))
    advice = lines[lines.index(verdict) + 1]
    assert lines.index(verdict) > 2
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
    assert doc["headline"][0] == doc["diagnosis"]["verdict"] and load["verdict"] in doc["headline"]
    assert doc["headline"].index(load["verdict"]) > doc["headline"].index(doc["diagnosis"]["verdict"])
    assert doc["diagnosis"]["causes"][0]["cause"] == "overload" and doc["diagnosis"]["causes"][0]["fix"]
    advice = {r["pool"]: r for r in doc["sections"]["pd_ratio"]["tables"][0]["rows"]}
    assert advice["decode"]["instances"] == 3 and advice["decode"]["lacks"] == 2
    assert advice["prefill"]["lacks"] == 0


def test_a_light_run_is_neither_saturated_nor_short_of_instances(light):
    report = make_report(light)
    assert report.load["saturated"] is False and report.load["pool"] is None
    verdict = report.load["verdict"]
    advice = report.headline[report.headline.index(verdict) + 1]
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


@pytest.mark.parametrize(("early", "late", "fmt", "words"), [
    (9.8, 3.7, ".1f", "fell from 9.8 to 3.7"),
    (606, 11_601, ",.0f", "grew from 606 to 11,601"),
    (0.0, 0.0, ".1f", "stayed at 0.0"),
    (5.04, 4.96, ".1f", "stayed at 5.0"),  # equal as printed: no direction claimed
])
def test_the_direction_word_is_computed_from_the_numbers_it_names(early, late, fmt, words):
    from tokentrace.app.report.headline import change_phrase
    assert change_phrase(early, late, fmt) == words


def test_a_saturated_pool_whose_queue_fell_is_not_said_to_have_grown():
    import pandas as pd

    from tokentrace.app.report.headline import load_sentence
    row = {"num_requests": 40, "arrival_window_s": 4.0, "offered_rps": 10.0, "served_rps": 3.0, "load_ratio": 3.3,
           "saturated": True, "saturated_pool": "colocated", "saturated_stage": "schedule.preempted"}
    pools = pd.DataFrame([{"role": "colocated", "utilisation": 0.31, "in_system_early": 9.8, "in_system_late": 3.7}])
    stages = pd.DataFrame([{"stage": "schedule.preempted", "role": "colocated", "early_ms": 606.0,
                            "late_ms": 11_601.0}])
    text = load_sentence(row, pools, stages)
    assert "requests in it fell from 9.8 to 3.7" in text and "grew from 9.8" not in text, text
    assert "schedule.preempted time per request grew from 606 to 11,601 ms" in text, text


def test_arrivals_within_a_blink_are_not_judged(tmp_path_factory):
    """20 requests arriving within 7 ms: enough requests, far too short a window to see a trend."""
    store = _store(tmp_path_factory, "blink", 20 / 0.007, 0.007 + 1e-9)
    report = make_report(store, "blink")
    assert report.load["saturated"] is None, report.load
    verdict = report.load["verdict"]  # after the SLO verdict and its causes on the first screen
    assert verdict in report.headline and verdict.startswith("Load not judged: the arrivals span 0.00"), verdict


def test_no_rate_is_given_over_a_window_of_a_blink(tmp_path_factory):
    """20 requests within 7 ms are 2,714 req/s only on paper: no offered rate is measured, printed or sized for."""
    store = _store(tmp_path_factory, "blink-rate", 20 / 0.007, 0.007 + 1e-9)
    report = make_report(store, "blink-rate")
    assert report.load["num_requests"] == 20 and 0 < report.load["arrival_window_s"] < 0.01, report.load
    assert report.load["offered_rps"] is None or math.isnan(report.load["offered_rps"]), report.load
    verdict = report.load["verdict"]
    assert "no offered rate over so short a window, served " in verdict and "over the 0.0 s" not in verdict, verdict
    text = render(report, "md")
    assert not re.search(r"[0-9,]{5,}(\.[0-9]+)? req/s", text), re.findall(r"[^.]*[0-9,]{5,}(?:\.[0-9]+)? req/s", text)
    advice = report.headline[report.headline.index(verdict) + 1]
    assert advice.startswith("Instances, with no offered rate"), advice


def test_the_prefill_workers_kv_transfer_is_the_prefill_pools_not_the_gateways():
    """The gateway records the prefill side of a KV transfer (it knows both clocks): it is prefill work."""
    from analyzers.load import stage_growth
    from tokentrace.schema import Role
    h = HandMade()
    h.instance(1, Role.GATEWAY).instance(2, Role.DECODE)
    for rid, arrival in enumerate((0.0, 100.0, 200.0), start=1):
        h.request(rid, arrival, arrival + 50).tokens(rid, [arrival + 10, arrival + 40])
        h.span(rid, Stage.TRANSFER_KV, arrival + 10, arrival + 20, 1, inst=1)
        h.span(rid, Stage.TRANSFER_KV, arrival + 20, arrival + 25, 1, inst=2)
    growth = stage_growth(h.source(), (0, 200_000_000))
    kv = growth[growth["stage"] == "transfer.kv"]
    assert sorted(kv["role"]) == ["decode", "prefill"], growth


def test_a_burst_gets_no_instance_advice_and_no_enough(tmp_path_factory):
    """20 requests within 7 ms: no offered rate to size pools for, so no pool is judged and nothing is 'enough'."""
    store = _store(tmp_path_factory, "blink-advice", 20 / 0.007, 0.007 + 1e-9)
    report = make_report(store, "blink-advice")
    advice = report.headline[report.headline.index(report.load["verdict"]) + 1]
    assert "has enough instances" not in advice and "lacks" not in advice, advice
    assert "not judged" in advice, advice
