"""Batch profile and interference over a hand-made store."""

from __future__ import annotations

import math

import pytest

from analyzers.batch import batch_profile, interference


@pytest.fixture
def steps(handmade):
    """Steps: 1 (0-10, 1 seq), 2 (10-30, 2 seqs), 3 (30-60, 3 seqs, 16 prefill tokens), 4 (60-70, 4 seqs).
    r1's tokens come out of steps 1..4 at 10, 30, 60, 70: ITLs 20 (step 2), 30 (step 3), 10 (step 4)."""
    h = handmade.request(1, 0, 70).tokens(1, [10, 30, 60, 70], steps=[1, 2, 3, 4])
    h.step(1, 0, 10, seqs=1, decode=1).step(2, 10, 30, seqs=2, decode=2)
    h.step(3, 30, 60, seqs=3, prefill=16, decode=2).step(4, 60, 70, seqs=4, decode=4)
    return h.source()


PROFILE = [  # (batch_size_lo, column, expected)
    (1, "num_steps", 1), (1, "num_tokens", 0), (2, "mean_step_ms", 20.0), (2, "mean_itl_ms", 20.0),
    (3, "num_steps", 2), (3, "mean_step_ms", 20.0), (3, "p99_step_ms", 10 + 0.99 * 20),
    (3, "num_tokens", 2), (3, "p99_itl_ms", 10 + 0.99 * 20),
]


@pytest.mark.parametrize(("lo", "column", "expected"), PROFILE)
def test_batch_profile(steps, lo, column, expected):
    df = batch_profile(steps).set_index("batch_size_lo")
    assert df.loc[lo, column] == pytest.approx(expected)


def test_bins_are_powers_of_two(steps):
    df = batch_profile(steps)
    assert list(zip(df["batch_size_lo"], df["batch_size_hi"])) == [(1, 1), (2, 2), (3, 4)]
    assert math.isnan(df.set_index("batch_size_lo").loc[1, "mean_itl_ms"])


def test_interference_slowest_against_median(steps):
    df = interference(steps).set_index("group")
    slow, median = df.loc["slowest"], df.loc["median"]
    assert slow["num_tokens"] == 1 and slow["mean_itl_ms"] == pytest.approx(30.0)
    assert slow["mean_other_prefill_tokens"] == pytest.approx(16.0)
    assert slow["share_with_prefill"] == 1.0 and slow["mean_batch_size"] == 3
    assert median["mean_itl_ms"] == pytest.approx(20.0)  # P45..P55 = 19..21 ms
    assert median["share_with_prefill"] == 0.0 and median["mean_step_ms"] == pytest.approx(20.0)


def test_median_falls_back_to_the_nearest_token(handmade):
    # Two decode tokens, ITL 10 and 100: no token between P45 and P55 (50.5 .. 59.5).
    h = handmade.request(1, 0, 200).tokens(1, [0, 10, 110], steps=[1, 2, 3])
    h.step(1, 0, 1).step(2, 1, 10).step(3, 10, 110, prefill=5)
    df = interference(h.source()).set_index("group")
    assert df.loc["median", "num_tokens"] == 1
    assert df.loc["slowest", "mean_itl_ms"] == pytest.approx(100.0)


def test_empty_and_bad_input(handmade):
    assert interference(handmade.source()).empty
    assert batch_profile(handmade.source()).empty
    with pytest.raises(ValueError):
        interference(handmade.source(), tail_fraction=2)


def test_a_prefill_workers_steps_are_binned_apart_from_the_decode_workers(handmade):
    """Prefill worker (2): two 100 ms prefill-only steps of 1 sequence. Decode worker (3): two 10 ms steps of 1
    sequence producing r1's tokens 1 and 2 (ITL 10 ms each). Mixed, the 1-sequence bin's step time would be
    55 ms against an ITL of 10."""
    from tokentrace.schema import Role
    h = handmade.instance(2, Role.PREFILL).instance(3, Role.DECODE)
    h.step(1, 0, 100, seqs=1, prefill=400, inst=2).step(2, 100, 200, seqs=1, prefill=400, inst=2)
    h.step(1, 200, 210, seqs=1, decode=1, inst=3).step(2, 210, 220, seqs=1, decode=1, inst=3)
    h.request(1, 0, 220).tokens(1, [200, 210, 220], steps=[1, 1, 2], inst=3)
    df = batch_profile(h.source()).set_index("role")
    assert df.loc["decode", "mean_step_ms"] == pytest.approx(10.0)
    assert df.loc["decode", "num_tokens"] == 2 and df.loc["decode", "p99_itl_ms"] == pytest.approx(10.0)
    assert df.loc["prefill", "mean_step_ms"] == pytest.approx(100.0) and df.loc["prefill", "num_tokens"] == 0
