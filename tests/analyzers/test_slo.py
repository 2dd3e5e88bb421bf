"""SLO attainment, DistServe goodput and Etalon fluidity over hand-made stores."""

from __future__ import annotations

import math

import numpy as np
import pytest
from handmade import MS

from analyzers.groups import ALL
from analyzers.slo import SloTargets, fluidity, goodput, request_fluidity, slo_attainment
from tokentrace.schema import col


@pytest.fixture
def five(handmade):
    """Default targets: interactive TTFT 500 / TPOT 100 ms, batch 30 s / 1 s.

    r1 interactive: arrival 0, tokens 100, 150, 200 -> TTFT 100, TPOT 50: good.
    r2 interactive: arrival 0, tokens 600, 650 -> TTFT 600 misses.
    r3 interactive: arrival 100, tokens 300, 600 -> TPOT 300 misses.
    r4 batch: arrival 200, tokens 1200, 2200 -> TTFT 1000, TPOT 1000: good.
    r5 batch: arrival 1000, no token, finish 1500: misses both.
    The run spans 0 .. 2200 ms.
    """
    h = handmade
    h.request(1, 0, 200).tokens(1, [100, 150, 200])
    h.request(2, 0, 650).tokens(2, [600, 650])
    h.request(3, 100, 600).tokens(3, [300, 600])
    h.request(4, 200, 2200, cls="batch").tokens(4, [1200, 2200])
    h.request(5, 1000, 1500, cls="batch", status=1)
    return h


def _row(df, name):
    return df.set_index(col.SLO_CLASS).loc[name]


ATTAINMENT = [  # (class, column, expected)
    ("interactive", "num_requests", 3), ("interactive", "ttft_attainment", 2 / 3),
    ("interactive", "tpot_attainment", 2 / 3), ("interactive", "attainment", 1 / 3),
    ("interactive", "ttft_target_ms", 500.0), ("batch", "tpot_target_ms", 1000.0),
    ("batch", "ttft_attainment", 1 / 2), ("batch", "attainment", 1 / 2), (ALL, "attainment", 2 / 5),
]


@pytest.mark.parametrize(("cls", "column", "expected"), ATTAINMENT)
def test_attainment(five, cls, column, expected):
    assert _row(slo_attainment(five.source()), cls)[column] == pytest.approx(expected)


def test_goodput_is_good_requests_per_second(five):
    df = goodput(five.source(), window_s=1.0)
    everything = _row(df, ALL)
    assert everything["duration_s"] == pytest.approx(2.2)
    assert everything["goodput_rps"] == pytest.approx(2 / 2.2)
    assert everything["request_rate_rps"] == pytest.approx(5 / 2.2)
    assert not everything["meets_target"]
    assert _row(df, "interactive")["goodput_rps"] == pytest.approx(1 / 2.2)
    # Windows of 1 s: [0, 1) has r1..r4 (rate 4/s, 2 good); [1, 2) has r5 (rate 1/s, 0 good).
    # Pooled from the quietest window up: 0/1, then 2/5 -> no rate reaches 90%.
    assert everything["attainment_constrained_rate_rps"] == 0.0
    df = goodput(five.source(), window_s=1.0, target_share=0.4)
    assert _row(df, ALL)["attainment_constrained_rate_rps"] == pytest.approx(4.0)


def test_constrained_rate_is_the_busiest_load_that_still_meets_the_target(handmade):
    # Window [0, 1 s): one good request. Window [1, 2 s): three requests with TTFT 600 ms (miss).
    h = handmade.request(1, 0, 100).tokens(1, [50, 100])
    for rid in (2, 3, 4):
        h.request(rid, 1000 + rid, 1700).tokens(rid, [1600 + rid, 1700])
    row = _row(goodput(h.source(), window_s=1.0), ALL)
    assert row["attainment_constrained_rate_rps"] == pytest.approx(1.0)
    assert row["attainment"] == pytest.approx(0.25)


def test_targets_from_the_manifest_then_arguments(five):
    manifest = {"config": {"slo": {"interactive": {"ttft_ms": 50, "tpot_ms": 10}}}}
    df = slo_attainment(five.source(manifest))
    assert _row(df, "interactive")["attainment"] == 0.0
    assert _row(df, "batch")["ttft_target_ms"] == 30_000.0  # not in the manifest: default
    bench_style = {"config": {"slo_ms": {"ttft": 1000, "tpot": 400}}}
    df = slo_attainment(five.source(bench_style))
    assert _row(df, "interactive")["attainment"] == pytest.approx(1.0)  # r2's 600 ms TTFT now meets 1 s
    df = slo_attainment(five.source(bench_style), targets={"interactive": SloTargets(ttft_ms=150, tpot_ms=400)})
    assert _row(df, "interactive")["attainment"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("bad", [{"ttft_ms": 0, "tpot_ms": 1}, {"ttft_ms": 1, "tpot_ms": math.inf}])
def test_bad_targets_are_value_errors(bad):
    with pytest.raises(ValueError):
        SloTargets(**bad)


def test_bad_target_share(five):
    with pytest.raises(ValueError):
        goodput(five.source(), target_share=1.5)


@pytest.fixture
def stream(handmade):
    """Interactive (TTFT 500, TPOT 100): tokens at 400, 700, 750, 950, 1000 ms after arrival 0.

    Deadlines: 500 (met); 600 (missed at 700 -> reset to 700); 800 (met); 900 (missed at 950 ->
    reset); 1050 (met): 2 of 5 missed. Without the reset tokens 2..4 would all miss.
    Batch (TTFT 30 s, TPOT 1 s): tokens at 100, 200: both met.
    """
    h = handmade.request(1, 0, 1000).tokens(1, [400, 700, 750, 950, 1000])
    h.request(2, 0, 200, cls="batch").tokens(2, [100, 200])
    return h.source()


def test_fluidity_index_resets_deadlines_after_a_miss(stream):
    per = request_fluidity(stream).set_index(col.REQUEST_ID)
    assert per.loc[1, "num_missed"] == 2
    assert per.loc[1, "fluidity_index"] == pytest.approx(0.6)
    df = fluidity(stream)
    assert _row(df, "interactive")["fluidity_index"] == pytest.approx(0.6)
    assert _row(df, "batch")["fluidity_index"] == 1.0
    assert _row(df, ALL)["fluidity_index"] == pytest.approx(5 / 7)
    assert _row(df, ALL)["mean_request_fluidity"] == pytest.approx(0.8)


def test_empty_store(handmade):
    src = handmade.source()
    assert _row(slo_attainment(src), ALL)["num_requests"] == 0
    assert math.isnan(_row(goodput(src), ALL)["goodput_rps"])
    assert _row(fluidity(src), ALL)["num_deadlines"] == 0


def _reference_missed(arrival_ns: int, times_ns: list[int], ttft_ns: int, tpot_ns: int) -> int:
    """Etalon's definition, one token at a time in exact integers: the deadlines of a request's tokens."""
    anchor, anchor_index, missed = arrival_ns + ttft_ns, 0, 0
    for i, t in enumerate(times_ns):
        if t > anchor + (i - anchor_index) * tpot_ns:
            missed, anchor, anchor_index = missed + 1, t, i
    return missed


def test_request_fluidity_matches_the_definition_token_by_token_on_many_requests(handmade):
    # Requests of 1 to 40 tokens in two classes, on a clock far from zero, with stalls that miss deadlines and
    # tokens landing exactly on one (met: a deadline is missed only when a token comes after it).
    rng = np.random.default_rng(7)
    targets = {"interactive": (500, 100), "batch": (30_000, 1_000)}  # ms, the defaults
    expected = {}
    base = 1_764_547_200_000  # ms: a wall clock (2025-12-01), past 2**53 ns
    for rid in range(1, 301):
        cls = "batch" if rid % 4 == 0 else "interactive"
        ttft, tpot = targets[cls]
        arrival = base + int(rng.integers(0, 60_000))
        n = int(rng.integers(1, 41))
        gaps = rng.choice([tpot // 2, tpot, tpot + 1, 3 * tpot], size=n, p=[0.5, 0.2, 0.2, 0.1]).astype(int)
        gaps[0] = rng.choice([ttft // 2, ttft, ttft + 1])
        times = (arrival + np.cumsum(gaps)).tolist()
        handmade.request(rid, arrival, times[-1], cls=cls).tokens(rid, times)
        expected[rid] = _reference_missed(arrival * MS, [t * MS for t in times], ttft * MS, tpot * MS)
    per = request_fluidity(handmade.source()).set_index(col.REQUEST_ID)
    assert per["num_missed"].to_dict() == expected
    assert sum(expected.values()) > 100 and min(expected.values()) == 0  # stalls were planted, and smooth requests
    assert (per["num_deadlines"] >= 1).all()
