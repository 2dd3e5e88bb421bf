"""Budget limits a metric can reach: finite, non-negative times, rates and counts, shares within
0..1, relative changes not below -100%; anything else is refused with one sentence (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokentrace.app.cli import app, register_commands
from tokentrace.app.report.budget import BudgetError, MetricKind, parse_budget

register_commands()
runner = CliRunner()


@pytest.mark.parametrize("metric,limit,fragment", [
    ("ttft.p99", "<= -5ms", "time limit cannot be negative"),
    ("ttft.p99", "<= 1e400ms", "must be a finite number"),
    ("itl.p50", "<= 1e309s", "must be a finite number"),
    ("slo.interactive.attainment", ">= 150%", "between 0 and 1"),
    ("unattributed.share", "<= 1.5", "between 0 and 1"),
    ("stage.decode.compute.share_of_itl", ">= -0.1", "between 0 and 1"),
    ("goodput.rps", ">= -1", "rate limit cannot be negative"),
    ("counters.dropped", "<= -1", "count limit cannot be negative"),
    ("regression.itl.p99", "<= -150%", "below -100%"),
    ("regression.ttft.p99", "<= 1e999ms", "must be a finite number"),
])
def test_limits_out_of_range_are_refused(metric, limit, fragment):
    with pytest.raises(BudgetError, match=fragment) as info:
        parse_budget(metric, limit, source="budget file b.toml")
    assert str(info.value).startswith("budget file b.toml: budget ") and "\n" not in str(info.value)


@pytest.mark.parametrize("metric,limit,value,kind", [
    ("ttft.p99", "<= 0ms", 0.0, MetricKind.TIME),
    ("slo.interactive.attainment", ">= 100%", 1.0, MetricKind.RATIO),
    ("unattributed.share", "<= 0", 0.0, MetricKind.RATIO),
    ("regression.itl.p99", "<= -5%", -0.05, MetricKind.RELATIVE),  # must improve by 5%
    ("regression.ttft.p99", "<= -10ms", -10.0, MetricKind.DELTA_TIME),
])
def test_limits_at_the_edges_of_their_range_are_kept(metric, limit, value, kind):
    budget = parse_budget(metric, limit)
    assert (budget.limit, budget.kind) == (pytest.approx(value), kind)


@pytest.mark.parametrize("entry", ['"ttft.p99" = "<= -5ms"', '"ttft.p99" = "<= 1e400ms"',
                                   '"slo.interactive.attainment" = ">= 150%"'])
def test_the_report_command_exits_2_on_such_a_budget(planted_stores, tmp_path: Path, entry: str):
    _, cand = planted_stores
    budget = tmp_path / "b.toml"
    budget.write_text(f"[budgets]\n{entry}\n")
    result = runner.invoke(app, ["report", str(cand), "--budget", str(budget)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: budget file ") and "Traceback" not in result.output
