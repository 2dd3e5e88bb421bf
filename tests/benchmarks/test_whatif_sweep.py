"""The what-if benchmark's measured SLO sweep: its passes' order, which runs each rate scale pools, the pooled
and per-pass curves and where they cross the goal."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # after the packages: benchmarks/analyzers.py is a script

from whatif_sweep import MeasuredSweep, breaks_line, later_passes, runs_by_scale  # noqa: E402

SCALES = (0.5, 1.0, 1.5, 2.0)


def test_each_pass_runs_the_rates_in_the_reverse_order_of_the_one_before() -> None:
    assert later_passes(SCALES, 1) == []
    assert later_passes(SCALES, 3) == [("p2-rate-2.0", 2.0), ("p2-rate-1.5", 1.5), ("p2-rate-0.5", 0.5),
                                       ("p3-rate-0.5", 0.5), ("p3-rate-1.5", 1.5), ("p3-rate-2.0", 2.0)]


def test_a_rate_pools_its_runs_of_every_pass_and_1x_every_base_run() -> None:
    runs = ["base-a", "rate-0.5", "base-1", "rate-1.5", "seqs", "rate-2.0", "p2-rate-2.0", "p2-rate-1.5",
            "p2-rate-0.5", "base-b"]
    assert runs_by_scale(SCALES, runs) == {0.5: ["rate-0.5", "p2-rate-0.5"], 1.0: ["base-a", "base-1", "base-b"],
                                          1.5: ["rate-1.5", "p2-rate-1.5"], 2.0: ["rate-2.0", "p2-rate-2.0"]}


def _flags(met: int, of: int) -> np.ndarray:
    return np.arange(of) < met


def test_the_pooled_curve_is_the_share_of_all_a_rates_requests_and_each_pass_has_its_own_break() -> None:
    sweep = MeasuredSweep({
        0.5: {"rate-0.5": _flags(10, 10), "p2-rate-0.5": _flags(10, 10)},
        1.0: {"base-a": _flags(10, 10), "base-b": _flags(8, 10), "base-c": _flags(9, 10)},
        1.5: {"rate-1.5": _flags(9, 10), "p2-rate-1.5": _flags(5, 10)},
        2.0: {"rate-2.0": _flags(3, 10), "p2-rate-2.0": _flags(1, 30)},
    })
    assert sweep.passes() == 2
    assert sweep.pooled() == pytest.approx({0.5: 1.0, 1.0: 0.9, 1.5: 0.7, 2.0: 0.1})
    assert sweep.one_pass(0) == pytest.approx({0.5: 1.0, 1.0: 1.0, 1.5: 0.9, 2.0: 0.3})
    assert sweep.one_pass(1) == pytest.approx({0.5: 1.0, 1.0: 0.8, 1.5: 0.5, 2.0: 1 / 30})
    assert sweep.one_pass(2) is None  # 1x has a third run, the other rates do not
    assert [f.size for f in sweep.pooled_flags()] == [20, 30, 20, 40]
    # Pass 1 crosses 90% at 1.5 exactly, then falls to 30% at 2x: the line 0.9 -> 0.3 passes 0.9 at 1.5;
    # pass 2 is below 90% from 1x on: between 0.5 (100%) and 1x (80%), halfway.
    line = breaks_line(sweep, 0.9)
    assert "pass 1 1.50 (100 100 90 30)" in line and "pass 2 0.75 (100 80 50 3)" in line
    assert line.endswith("pass 2 against pass 1 50% (bar 15%)")  # a second pass read as the first's prediction
