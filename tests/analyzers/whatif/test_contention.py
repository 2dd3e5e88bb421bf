"""The contention check (analyzers/whatif/contention.py) on hand-made runs written as real Parquet.

Requests open and close in phases (2, then 12, then 5 streams in flight), each relaying a token every 100 ms; the
engine steps every 60 ms. The load the check reads at each step is compared with what the hand-made requests say
(not with the analyzer's own arithmetic), and a step time planted to grow with the streams in flight is found to
grow with them, where a step time drawn independently of the load is not.
"""

from __future__ import annotations

import numpy as np
import pytest

from analyzers.source import Source
from analyzers.whatif.contention import load_relation, spearman, step_load, step_ratios
from analyzers.whatif.models import StepTimeModel
from analyzers.whatif.trace import read_trace
from tokentrace.schema import Role, col
from tokentrace.store import open_run

MS = 1_000_000
STEP_EVERY_MS = 60
BASE_STEP_MS = 20.0
TOKEN_EVERY_MS = 100
PHASES = ((0, 2000, 2), (2000, 4000, 12), (4000, 6000, 5))  # (from, to, streams in flight), ms
_FLAT = StepTimeModel(BASE_STEP_MS * MS, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, (1.0,), (0.0,))


def _requests() -> list[tuple[int, float, list[float]]]:
    """(request id, arrival, token deliveries) per request: each phase's streams open at its start (staggered by
    1 ms) and deliver a token every 100 ms until its end."""
    out, rid = [], 1
    for lo, hi, n in PHASES:
        for k in range(n):
            arrival = lo + k
            out.append((rid, arrival, [float(t) for t in np.arange(arrival + 50, hi - 1, TOKEN_EVERY_MS)]))
            rid += 1
    return out


def _in_flight_at(t_ms: float) -> int:
    return sum(1 for _, a, toks in _requests() if a <= t_ms < toks[-1])


def _write(handmade, tmp_path, step_ms) -> Source:
    """The hand-made run with the engine's k-th step (starting at 60 k ms) lasting ``step_ms(k, start)``."""
    h = handmade.instance(0, Role.GATEWAY).instance(1, Role.COLOCATED)
    for rid, arrival, toks in _requests():
        h.request(rid, arrival, toks[-1], prompt=16, cached=0, output=len(toks), inst=0)
        h.request(rid, arrival + 0.5, toks[-1] - 1, prompt=16, cached=0, output=len(toks), inst=1)
        h.tokens(rid, [t - 1 for t in toks], inst=1)
        h.tokens(rid, toks, inst=0, kind="sent")
    for k, start in enumerate(range(0, PHASES[-1][1], STEP_EVERY_MS)):
        h.step(k, start, start + step_ms(k, start), seqs=4, decode=4, running=4)
    # the event loop ran late over the first half of every 10th step
    for k, start in enumerate(range(0, PHASES[-1][1], STEP_EVERY_MS)):
        if k % 10 == 0:
            h.rows["loop_lags"].append({col.INSTANCE_ID: 0, col.START_NS: start * MS,
                                        col.END_NS: int((start + step_ms(k, start) / 2) * MS)})
    h.write(tmp_path)
    return Source.of_run(open_run(tmp_path, "run-1"))


def test_the_load_read_at_each_step_is_the_hand_made_requests_load_and_a_planted_slowdown_follows_it(handmade,
                                                                                                   tmp_path):
    def planted(k, start):  # 20 ms, 5% longer per stream in flight at the step's start
        return BASE_STEP_MS * (1 + 0.05 * _in_flight_at(start))

    src = _write(handmade, tmp_path, planted)
    try:
        steps = read_trace(src).steps
        load = step_load(src, steps)
    finally:
        src.close()
    mid_ms = (steps.start_ns + steps.duration_ns / 2) / MS
    assert list(load.in_flight) == [_in_flight_at(t) for t in mid_ms]
    deliveries = np.array([t for _, _, toks in _requests() for t in toks])
    assert list(load.relayed_per_s) == [float(((deliveries >= t - 500) & (deliveries < t + 500)).sum())
                                        for t in mid_ms]
    lagged = np.arange(steps.num_seqs.size) % 10 == 0
    assert load.loop_lag_share[lagged] == pytest.approx(0.5, abs=1e-6)
    assert not load.loop_lag_share[~lagged].any()

    ratio = step_ratios(_FLAT, steps)
    found = load_relation(ratio, load.in_flight)
    assert found.rank_correlation > 0.9
    medians = [q[2] for q in found.quartiles]
    assert medians == sorted(medians) and medians[-1] > 1.4 * medians[0]
    assert found.slope == pytest.approx(np.log(1 + 0.05 * 12) / 12, rel=0.25)
    assert load_relation(ratio, load.relayed_per_s).rank_correlation > 0.8  # 10 tokens/s per stream


def test_a_step_time_independent_of_the_load_shows_no_relation(handmade, tmp_path):
    noise = np.random.default_rng(11).lognormal(0.0, 0.3, 200)
    src = _write(handmade, tmp_path, lambda k, start: BASE_STEP_MS * noise[k])
    try:
        steps = read_trace(src).steps
        load = step_load(src, steps)
    finally:
        src.close()
    found = load_relation(step_ratios(_FLAT, steps), load.in_flight)
    assert abs(found.rank_correlation) < 0.2
    medians = [q[2] for q in found.quartiles]
    assert max(medians) < 1.25 * min(medians)


def test_spearman_is_nan_where_a_side_is_constant_and_ranks_otherwise():
    assert np.isnan(spearman([1, 2, 3, 4], [5, 5, 5, 5]))
    assert spearman([1, 2, 3, 4], [10, 20, 40, 80]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [8, 4, 2, 1]) == pytest.approx(-1.0)
