"""The what-if benchmark's changes run twice: which runs repeat them, and how the simulator and a rerun (the second
run as the prediction of the first) are each held to the bar."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # after the packages: benchmarks/analyzers.py is a script

from whatif_reruns import CHANGES, RerunTally, later_changes, rel, second_run, spread  # noqa: E402
from whatif_sweep import rate_run  # noqa: E402


def bar(noise: float) -> float:
    return max(0.15, 1.5 * noise) if math.isfinite(noise) else 0.15


def test_every_change_has_a_second_run_and_the_rates_second_runs_are_the_sweeps_second_pass() -> None:
    assert second_run("rate-0.5") == rate_run(0.5, 2) and second_run("rate-1.5") == rate_run(1.5, 2)
    assert later_changes(2) == ["p2-budget", "p2-seqs"]  # the reverse of their first runs' order
    assert later_changes(1) == []
    assert {second_run(n) for n in CHANGES} - {second_run(n) for n in CHANGES if n.startswith("rate-")} \
        == set(later_changes(3))


def test_a_rerun_and_the_simulator_meet_the_same_bar_and_the_mean_gets_the_larger_noise() -> None:
    tally = RerunTally(("ttft.p50", "itl.p99"), bar)
    # ttft.p50: the rerun is 20% off the first run, the simulator 10%: with base noise 4% the bar is 15%.
    # itl.p99: the second run took twice the first's (own noise 67%); the simulator is 30% off the first run and
    # 13% off their mean; the base noise (4%) gives the first-run comparisons a 15% bar, the mean's 100%.
    tally.add("seqs", {"ttft.p50": 110.0, "itl.p99": 130.0}, {"ttft.p50": 100.0, "itl.p99": 100.0},
              {"ttft.p50": 120.0, "itl.p99": 200.0}, {"ttft.p50": 0.04, "itl.p99": 0.04})
    assert tally.counts() == {"simulator": 1, "rerun": 0, "simulator vs mean": 2}
    # Where the base runs were as noisy as the rerun, the bar takes the rerun in.
    wide = RerunTally(("ttft.p50",), bar)
    wide.add("rate-0.5", {"ttft.p50": 110.0}, {"ttft.p50": 100.0}, {"ttft.p50": 120.0}, {"ttft.p50": 0.14})
    assert wide.counts() == {"simulator": 1, "rerun": 1, "simulator vs mean": 1}
    lines = tally.lines()
    assert lines[0].startswith("seqs run twice (seqs, p2-seqs): own noise ttft.p50 18%  itl.p99 67%")
    assert "the second run as a prediction of the first ttft.p50 20%  itl.p99 100%" in lines[0]
    assert lines[-1].startswith("changes run twice (1 of 4)") and "the simulator 1/2, the second run as the prediction 0/2" \
        in lines[-1]


def test_rel_and_spread_say_nan_where_a_value_is_missing() -> None:
    assert rel(110.0, 100.0) == pytest.approx(0.1) and math.isnan(rel(math.nan, 100.0)) and math.isnan(rel(1.0, 0.0))
    assert spread(100.0, 150.0) == pytest.approx(0.4)
