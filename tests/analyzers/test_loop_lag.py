"""Why an event loop ran late: the CPU split of ``loop_lags`` rows, and the diagnosis causes it names.

Hand-made rows with hand-computed shares (``analyzers.loop_lag``'s rule: CPU over the tick's window
``end - armed``, the loop's own thread first, the process's other threads next, the rest starved)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analyzers.diagnosis import FIXES, Targets, diagnose
from analyzers.loop_lag import loop_lag
from analyzers.source import Source
from tokentrace.schema import LOOP_LAGS, SCHEMA_VERSION_KEY, TABLE_NAME_KEY, Role, Stage, col
from tokentrace.store import open_run

MS = 1_000_000


def _lag(h, inst: int, armed: float, due: float, ran: float, loop_cpu: float | None, process_cpu: float | None):
    """A late tick armed at ``armed``, due at ``due``, run at ``ran`` (ms), with its CPU times (ms; None: not
    recorded)."""
    measured = loop_cpu is not None
    h.rows["loop_lags"].append({
        col.INSTANCE_ID: inst, col.START_NS: int(due * MS), col.END_NS: int(ran * MS),
        col.ARMED_NS: int(armed * MS) if measured else None,
        col.LOOP_CPU_NS: int(loop_cpu * MS) if measured else None,
        col.PROCESS_CPU_NS: int(process_cpu * MS) if measured else None})


def test_each_late_interval_splits_by_who_had_the_cpu(handmade):
    """Windows of 30 ms (armed at 0, due at 10, ran at 30: 20 ms late), one per profile."""
    h = handmade
    h.instance(1, Role.GATEWAY)
    h.request(1, 0, 600, prompt=10).tokens(1, [600])
    h.span(1, Stage.GATEWAY_ACCEPT, 0, 600, 0)
    _lag(h, 1, 0, 10, 30, 27, 28)  # the loop's thread ran 27 of 30 ms: 0.9 blocking, 1/30 other, the rest starved
    _lag(h, 1, 100, 110, 130, 1.5, 24)  # another thread ran 22.5 ms: 0.05 blocking, 0.75 other, 0.2 starved
    _lag(h, 1, 200, 210, 230, 0, 0.3)  # nobody ran: 0.01 other, 0.99 starved
    _lag(h, 1, 300, 310, 330, 3, 90)  # three CPUs' worth: the other threads take all that is left
    _lag(h, 1, 400, 410, 430, None, None)  # an old row: not split
    (row,) = loop_lag(h.source()).instances.to_dict("records")
    assert row["late_ticks"] == 5 and row["late_ms"] == pytest.approx(100.0)
    assert row["blocking_ms"] == pytest.approx(20 * (0.9 + 0.05 + 0 + 0.1))
    assert row["other_threads_ms"] == pytest.approx(20 * (1 / 30 + 0.75 + 0.01 + 0.9))
    assert row["starved_ms"] == pytest.approx(20 * ((1 - 0.9 - 1 / 30) + 0.2 + 0.99 + 0))
    assert row["unsplit_ms"] == pytest.approx(20.0)
    assert row["cause"] == "mixed"  # the largest, other threads' 33.9 ms, is under half of the 80 ms measured


def test_the_main_cause_holds_half_the_measured_late_time(handmade):
    h = handmade
    h.instance(1, Role.GATEWAY)
    h.request(1, 0, 300, prompt=10).tokens(1, [300])
    h.span(1, Stage.GATEWAY_ACCEPT, 0, 300, 0)
    _lag(h, 1, 0, 10, 30, 0, 0)  # starved 20 ms
    _lag(h, 1, 100, 110, 130, 27, 28)  # blocking 18 ms, other threads 0.7 ms, starved 1.3 ms
    (row,) = loop_lag(h.source()).instances.to_dict("records")
    assert row["cause"] == "starved" and row["starved_ms"] == pytest.approx(20 + 20 * (1 - 0.9 - 1 / 30))


def _slow_accept(h):
    """Request 1 accepted in 100 ms (then a 20 ms prefill); requests 2 and 3 in 1 ms: the stage is not slow."""
    h.request(1, 0, 120, prompt=10).tokens(1, [120])
    h.span(1, Stage.GATEWAY_ACCEPT, 0, 100, 0)
    h.span(1, Stage.PREFILL_COMPUTE, 100, 120, 0, step=1)
    for rid in (2, 3):
        h.request(rid, rid * 1000, rid * 1000 + 21, prompt=10).tokens(rid, [rid * 1000 + 21])
        h.span(rid, Stage.GATEWAY_ACCEPT, rid * 1000, rid * 1000 + 1, 0)
    return h


@pytest.mark.parametrize(("loop_cpu", "process_cpu", "cause"), [
    (29, 29.5, "event_loop_lag"), (0.5, 28, "gil_contention"), (0.2, 0.6, "cpu_starved")])
def test_the_diagnosis_names_the_reason_the_loop_ran_late(handmade, loop_cpu, process_cpu, cause):
    """Request 1's gateway.accept (0-100 ms) waited on a loop 80 ms late (armed at 0, due at 10, ran at 90);
    requests 2 and 3 are accepted in 1 ms: the stage is not slow for every request."""
    h = _slow_accept(handmade)
    _lag(h, 1, 0, 10, 90, loop_cpu * 3, process_cpu * 3)  # the window is 90 ms: CPU in thirds of it
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    causes = d.causes[d.causes[col.REQUEST_ID] == 1].sort_values("rank").to_dict("records")
    first = causes[0]
    assert first["cause"] == cause and first["stage"] == "gateway.accept", causes
    assert first["fix"] == FIXES[cause] and first["fix"]
    assert sum(c["ms"] for c in causes if c["cause"] != "unknown") == pytest.approx(70.0)  # 80 late, 70 over target
    assert first["ms"] >= 0.9 * 70.0
    assert set(d.requests["first_cause"]) == {cause}


def test_a_store_without_the_cpu_columns_reads_them_as_null_and_names_event_loop_lag(handmade, tmp_path):
    """A run written before schema version 6: its loop_lags files have no CPU columns."""
    h = _slow_accept(handmade)
    _lag(h, 1, 0, 10, 90, None, None)
    h.write(tmp_path)
    (part,) = open_run(tmp_path / "run-1").files(LOOP_LAGS.name)
    old = pa.table({col.INSTANCE_ID: [1], col.START_NS: [10 * MS], col.END_NS: [90 * MS]}).replace_schema_metadata(
        {SCHEMA_VERSION_KEY: b"5", TABLE_NAME_KEY: LOOP_LAGS.name.encode()})
    pq.write_table(old, part)  # as version 5 wrote it
    run = open_run(tmp_path / "run-1")
    assert run.table(LOOP_LAGS.name).column(col.LOOP_CPU_NS).to_pylist() == [None]
    src = Source.of_run(run)
    (row,) = loop_lag(src).instances.to_dict("records")
    assert row["unsplit_ms"] == pytest.approx(80.0) and row["cause"] == ""
    d = diagnose(src, targets=Targets(ttft_ms=50))
    first = d.causes[d.causes[col.REQUEST_ID] == 1].sort_values("rank").iloc[0]
    assert first["cause"] == "event_loop_lag" and "recorded no CPU times" in first["evidence"]
