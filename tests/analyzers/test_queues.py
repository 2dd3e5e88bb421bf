"""Queue timeline, queueing delay and the Little's-law check over hand-made stores."""

from __future__ import annotations

import pytest

from analyzers.groups import ALL
from analyzers.queues import littles_law, queue_timeline, queueing_delay, queues
from tokentrace.schema import Stage, col


def test_timeline_buckets_steps_by_end_time(handmade):
    h = handmade.request(1, 0, 1010)
    h.step(1, 0, 10, waiting=2, running=1)
    h.step(2, 10, 20, waiting=0, running=3)
    h.step(3, 1000, 1010, waiting=1, running=1, preempted=1)
    df = queue_timeline(h.source(), bucket_s=1.0).set_index("t_s")
    assert list(df.index) == [0.0, 1.0]
    assert df.loc[0.0, col.NUM_WAITING] == pytest.approx(1.0)
    assert df.loc[0.0, col.NUM_RUNNING] == pytest.approx(2.0)
    assert df.loc[0.0, "max_waiting"] == 2
    assert df.loc[1.0, col.NUM_PREEMPTED] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        queue_timeline(h.source(), bucket_s=0)


def test_queueing_delay_per_class(handmade):
    # r1 interactive waits 0-4 and 6-8 (6 ms); r2 batch waits 10 ms; r3 interactive never waits.
    h = handmade
    h.request(1, 0, 20).tokens(1, [20]).span(1, Stage.SCHEDULE_QUEUE, 0, 4, 0).span(1, Stage.SCHEDULE_QUEUE, 6, 8, 0)
    h.request(2, 0, 20, cls="batch").tokens(2, [20]).span(2, Stage.SCHEDULE_QUEUE, 0, 10, 0)
    h.request(3, 0, 20).tokens(3, [20])
    df = queueing_delay(h.source()).set_index(col.SLO_CLASS)
    assert df.loc["interactive", "count"] == 2
    assert df.loc["interactive", "mean_ms"] == pytest.approx(3.0)
    assert df.loc["interactive", "max_ms"] == pytest.approx(6.0)
    assert df.loc["batch", "p50_ms"] == pytest.approx(10.0)
    assert df.loc[ALL, "mean_ms"] == pytest.approx(16 / 3)
    assert df.loc[ALL, "p50_ms"] == pytest.approx(6.0)
    assert list(df.index)[-1] == ALL


def test_queueing_delay_counts_a_wait_only_inside_the_requests_token_intervals(handmade):
    # Token 1's queue span starts at 5 ms, while token 0 (delivered at 10) was still on its way: only its 5 ms
    # inside token 1's interval (10, 20] are the request's latency, as the stage breakdown counts them.
    h = handmade.request(1, 0, 20).tokens(1, [10, 20]).span(1, Stage.SCHEDULE_QUEUE, 5, 15, 1)
    df = queueing_delay(h.source()).set_index(col.SLO_CLASS)
    assert df.loc[ALL, "mean_ms"] == pytest.approx(5.0)


@pytest.mark.parametrize(("second_step_running", "l_measured", "error"), [(2, 2.0, 0.0), (1, 1.5, -0.25)])
def test_littles_law(handmade, second_step_running, l_measured, error):
    # Two requests in the system for the whole 20 ms window: lambda = 100/s, W = 20 ms, lambda W = 2.
    h = handmade.request(1, 0, 20).request(2, 0, 20)
    h.step(1, 0, 10, waiting=1, running=1).step(2, 10, 20, running=second_step_running)
    row = littles_law(h.source()).iloc[0]
    assert row["arrival_rate_rps"] == pytest.approx(100.0)
    assert row["mean_time_in_system_s"] == pytest.approx(0.02)
    assert row["lambda_w"] == pytest.approx(2.0)
    assert row["mean_in_system"] == pytest.approx(l_measured)
    assert row["relative_error"] == pytest.approx(error)


def test_queues_bundle_and_empty_store(handmade):
    q = queues(handmade.source())
    assert q.timeline.empty and q.littles_law.empty
    assert q.delay.set_index(col.SLO_CLASS).loc[ALL, "count"] == 0
