"""diff(): bootstrap confidence intervals, significance and regressions between two runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.diff import _CHUNK, DIFF_COLUMNS, STATISTICS, _boot_statistics, _counts, diff, run_bootstrap
from tokentrace.schema import Stage


def _run(make_store, itl_ms: float, n: int = 30, jitter: float = 1.0):
    """n requests: TTFT 10 ms, then 4 tokens ITL itl_ms +- jitter (deterministic pattern), all decode.compute."""
    h = make_store()
    for rid in range(1, n + 1):
        arrival = rid * 100.0
        times, t = [arrival + 10], arrival + 10
        h.span(rid, Stage.PREFILL_COMPUTE, arrival, t, 0)
        for i in range(1, 5):
            gap = itl_ms + jitter * (((rid * 7 + i * 3) % 5) - 2) / 2
            h.span(rid, Stage.DECODE_COMPUTE, t, t + gap, i)
            t += gap
            times.append(t)
        h.request(rid, arrival, t).tokens(rid, times)
    return h.source()


def _row(df, metric, statistic="mean"):
    return df[(df["metric"] == metric) & (df["statistic"] == statistic)].iloc[0]


def test_planted_regression_is_flagged(make_store):
    df = diff(_run(make_store, 10.0), _run(make_store, 20.0), resamples=200)
    itl = _row(df, "itl", "p99")
    assert itl["regression"] and itl["significant"]
    assert _row(df, "itl")["rel_change"] == pytest.approx(1.0, rel=0.05)
    stage = _row(df, "stage.decode.compute.itl")
    assert stage["regression"] and stage["ci_low"] > 0
    assert not _row(df, "ttft")["significant"]  # TTFT is 10 ms in both
    assert not _row(df, "stage.prefill.compute.ttft")["significant"]


def test_an_improvement_is_significant_but_not_a_regression(make_store):
    row = _row(diff(_run(make_store, 20.0), _run(make_store, 10.0), resamples=200), "itl")
    assert row["significant"] and not row["regression"] and row["delta"] < 0


def test_small_effects_are_not_significant(make_store):
    # 1% slower, no jitter: the CI excludes 0 but the change is under the 2% minimum effect.
    row = _row(diff(_run(make_store, 10.0, jitter=0), _run(make_store, 10.1, jitter=0), resamples=100), "itl")
    assert row["ci_low"] > 0
    assert row["rel_change"] == pytest.approx(0.01)
    assert not row["significant"]


def test_seeded_and_shaped(make_store):
    a, b = _run(make_store, 10.0), _run(make_store, 12.0)
    first, second = diff(a, b, resamples=50, seed=3), diff(a, b, resamples=50, seed=3)
    assert first.equals(second)
    assert list(first.columns) == DIFF_COLUMNS
    assert len(first) == 4 * 4 + 2 * (len(Stage) + 1)


@pytest.mark.parametrize("kwargs", [{"resamples": 5}, {"confidence": 1.0}, {"min_effect": -0.1}])
def test_bad_arguments(make_store, kwargs):
    src = _run(make_store, 10.0, n=3)
    with pytest.raises(ValueError):
        diff(src, src, **kwargs)


@settings(max_examples=8, deadline=None)
@given(itls=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=4), min_size=2, max_size=6))
def test_a_run_against_itself_flags_nothing(make_store, itls):
    h = make_store()
    for rid, gaps in enumerate(itls, start=1):
        t = rid * 100.0 + 5
        times = [t]
        for g in gaps:
            t += g
            times.append(t)
        h.request(rid, rid * 100.0, t).tokens(rid, times).span(rid, Stage.SCHEDULE_QUEUE, rid * 100.0, times[0], 0)
    src = h.source()
    df = diff(src, src, resamples=30)
    assert not df["significant"].any()
    assert not df["regression"].any()
    assert (df["delta"] == 0).all()


def test_resampled_percentiles_are_those_of_the_drawn_resample():
    # Each resample is counted, not gathered: its statistics must be numpy's of the values it draws.
    x = np.random.default_rng(5).lognormal(size=301)
    x[::7] = x[3]  # ties
    got = _boot_statistics(x, np.random.default_rng(1), 60)
    rng, xs = np.random.default_rng(1), np.sort(x)
    for lo in range(0, 60, _CHUNK):
        counts = _counts(xs.size, min(_CHUNK, 60 - lo), rng)
        for r, w in enumerate(counts):
            drawn = np.repeat(xs, w)
            want = [drawn.mean() if q is None else np.percentile(drawn, q) for q in STATISTICS.values()]
            assert got[:, lo + r] == pytest.approx(want, rel=1e-12)


def test_each_run_is_resampled_on_its_own_stream(make_store):
    a = _run(make_store, 10.0)
    as_baseline, as_candidate = run_bootstrap(a, "baseline", resamples=50), run_bootstrap(a, "candidate", resamples=50)
    assert list(as_baseline["value"]) == list(as_candidate["value"])
    itl = (as_baseline["metric"] == "itl") & (as_baseline["statistic"] == "mean")
    assert not np.array_equal(as_baseline[itl]["draws"].iloc[0], as_candidate[itl]["draws"].iloc[0])
    # a run against itself: delta 0, and an interval from two independent resamplings, not a point
    row = _row(diff(a, a, resamples=50), "itl")
    assert row["delta"] == 0 and row["ci_low"] < 0 < row["ci_high"]
    # the baseline's side does not depend on the candidate it is compared with
    with_b = diff(a, _run(make_store, 12.0), resamples=50)
    with_c = diff(a, _run(make_store, 30.0), resamples=50)
    assert list(with_b["baseline"]) == list(with_c["baseline"])
    with pytest.raises(ValueError):
        run_bootstrap(a, "control")
