"""The saturation verdict on a real deployment: overloaded, it says so and names the pool; lightly loaded, it does not.

The reference server runs disaggregated (one prefill and one decode worker, tiny model)
under ``tokentrace run``, with a known, low decode capacity: every decode step sleeps a
planted 50 ms (``--delay decode_step=50ms``) and a worker runs one sequence at a time
(``--max-num-seqs 1``), so a request of 6 output tokens holds the decode worker for 5
steps, at least 250 ms: at most 4 requests/s. Prefill of a 24-token prompt takes a few
ms. The load generator sends requests at a constant rate over loopback:

* overloaded: 20 requests at 10 requests/s, at least 2.5x the decode capacity (a busy
  machine only lowers the capacity further);
* lightly loaded: 10 requests at 1.5 requests/s, under 40% of it.

No timing is asserted: only what the report concludes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from planted_runs import traced_deployment
from typer.testing import CliRunner

from tokentrace.app.bench.arrivals import Arrivals
from tokentrace.app.bench.client import RequestOptions
from tokentrace.app.bench.plan import build_plan
from tokentrace.app.bench.runner import RunLimits, run_bench
from tokentrace.app.bench.synthetic import LengthDist, SyntheticSpec
from tokentrace.app.cli import app, register_commands
from tokentrace.app.report import make_report

SERVER_ARGS = ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--max-num-seqs", "1",
               "--delay", "decode_step=50ms"]

register_commands()


def _drive(store: Path, run: str, *, rate_rps: float, num_requests: int) -> None:
    plan = build_plan(synthetic=SyntheticSpec(LengthDist("fixed", 24), LengthDist("fixed", 6)),
                      max_requests=num_requests, arrivals=Arrivals("constant", rate_rps), key_prefix=run)
    with traced_deployment(store, run, ["--num-device-blocks", "512", *SERVER_ARGS]) as url:
        result = run_bench(plan, RequestOptions(url, model="tiny"), RunLimits(duration_s=60, drain_s=60))
    assert all(o.ok for o in result.outcomes), [o.detail for o in result.outcomes if not o.ok]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saturation")
    _drive(root, "overloaded", rate_rps=10.0, num_requests=20)
    _drive(root, "light", rate_rps=1.5, num_requests=10)
    return root


def test_overloaded_deployment_reports_saturation_and_asks_for_the_saturated_pool(store):
    result = CliRunner().invoke(app, ["report", str(store), "--run", "overloaded", "--format", "md"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line]
    assert lines[1].startswith("**SLO MISSED: ") and lines[2].startswith("Why #1: overload"), lines[:3]
    verdict = next(line for line in lines if line.startswith("**SATURATED"))
    advice = lines[lines.index(verdict) + 1]
    assert "The decode pool saturates" in verdict, verdict
    report = make_report(store, "overloaded")
    assert report.load["saturated"] is True and report.load["pool"] == "decode"
    assert report.load["offered_rps"] > 2 * report.load["served_rps"]
    rec = report.section("pd_ratio").tables[0][1].set_index("pool")
    assert rec.loc["decode", "lacks"] >= 1 and rec.loc["prefill", "lacks"] == 0, rec
    assert "lacks" in advice and "decode instance(s)" in advice, advice


def test_lightly_loaded_deployment_says_neither(store):
    report = make_report(store, "light")
    assert report.load["saturated"] is False and report.load["pool"] is None, report.load
    assert report.load["verdict"].startswith("Not saturated")
    rec = report.section("pd_ratio").tables[0][1]
    assert (rec["lacks"] == 0).all(), rec
    advice = report.headline[report.headline.index(report.load["verdict"]) + 1]
    if report.diagnosis["num_missed"]:  # a busy machine can still make a request miss: then no all-clear
        assert "more instances are not the fix" in advice, advice
    else:
        assert report.headline[0].startswith("SLO met") and "has enough instances" in advice, advice
