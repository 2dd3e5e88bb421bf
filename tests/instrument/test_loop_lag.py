"""Event-loop lag: the sampler records a loop that was kept busy, and the analyzer says which
stage's time fell inside the late intervals."""

from __future__ import annotations

import asyncio
import time

import pyarrow as pa
import pytest

from analyzers.loop_lag import loop_lag
from analyzers.source import Source
from instrument.loop_lag import LoopLagSampler
from tokentrace.recorder import BufferedRecorder, InMemorySink
from tokentrace.schema import INSTANCES, LOOP_LAGS, SPANS, Role, Stage, col

MS = 1_000_000


def test_a_loop_kept_busy_is_recorded_as_late_ticks():
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=4, flush_interval_s=60)
    sampler = LoopLagSampler(rec, period_ns=5 * MS, min_lag_ns=2 * MS)

    async def main() -> None:
        sampler.ensure_running()
        await asyncio.sleep(0.02)
        time.sleep(0.05)  # a callback that holds the loop for 50 ms
        await asyncio.sleep(0.03)
        sampler.close()

    asyncio.run(main())
    rec.flush()
    rows = sink.table(LOOP_LAGS.name).to_pylist()
    rec.close()
    assert sampler.num_ticks >= 2
    longest = max(rows, key=lambda r: r[col.END_NS] - r[col.START_NS])
    assert longest[col.END_NS] - longest[col.START_NS] >= 40 * MS  # the planted 50 ms, less the tick period
    assert all(r[col.INSTANCE_ID] == 4 for r in rows)
    # A sleep holds the loop without using its CPU: the row says so (the process CPU holds the thread's,
    # within the two clocks' reads a few instructions apart).
    assert all(r[col.ARMED_NS] <= r[col.START_NS] and 0 <= r[col.LOOP_CPU_NS] <= r[col.PROCESS_CPU_NS] + MS
               for r in rows)
    assert longest[col.LOOP_CPU_NS] < 20 * MS, longest


def test_closing_before_the_loop_ends_leaves_nothing_pending():
    rec = BufferedRecorder(InMemorySink(), instance_id=1, flush_interval_s=60)
    sampler = LoopLagSampler(rec)

    async def main() -> int:
        sampler.ensure_running()
        sampler.ensure_running()  # once only
        await asyncio.sleep(0.03)
        sampler.close()
        await asyncio.sleep(0.03)
        return sampler.num_ticks

    ticks = asyncio.run(main())
    assert sampler.num_ticks == ticks  # no tick after close
    rec.close()
    with pytest.raises(ValueError):
        LoopLagSampler(rec, period_ns=0)


def _table(t, rows):
    return pa.Table.from_pydict({c.name: [r.get(c.name) for r in rows] for c in t.columns}, schema=t.schema)


def test_the_analyzer_splits_stage_time_inside_and_outside_late_ticks():
    """Gateway (instance 1): gateway.accept 0-10 ms and 20-30 ms, stream.relay 40-50 ms; the loop ran
    late 5-15 ms and 45-47 ms. The worker (instance 2) was not sampled: its spans do not count."""
    gw, worker = 1, 2
    inst = _table(INSTANCES, [
        {col.INSTANCE_ID: i, col.ROLE: int(r), col.NAME: n, col.HOST: "h", col.PID: 1, col.MONO_ANCHOR_NS: 0,
         col.WALL_ANCHOR_NS: 0, col.CLOCK_OFFSET_NS: 0} for i, r, n in ((gw, Role.GATEWAY, "gateway-1"),
                                                                         (worker, Role.DECODE, "decode-0"))])
    spans = _table(SPANS, [
        {col.REQUEST_ID: 7, col.STAGE: int(st), col.TOKEN_INDEX: 0, col.START_NS: a * MS, col.END_NS: b * MS,
         col.INSTANCE_ID: i}
        for st, a, b, i in ((Stage.GATEWAY_ACCEPT, 0, 10, gw), (Stage.GATEWAY_ACCEPT, 20, 30, gw),
                            (Stage.STREAM_RELAY, 40, 50, gw), (Stage.DECODE_COMPUTE, 0, 50, worker))])
    lags = _table(LOOP_LAGS, [{col.INSTANCE_ID: gw, col.START_NS: a * MS, col.END_NS: b * MS}
                              for a, b in ((5, 15), (45, 47))])
    lag = loop_lag(Source.of_tables(spans=spans, loop_lags=lags, instances=inst))
    (row,) = lag.instances.to_dict("records")
    assert (row["instance"], row["role"], row["late_ticks"]) == ("gateway-1", "gateway", 2)
    assert row["late_ms"] == pytest.approx(12.0) and row["longest_ms"] == pytest.approx(10.0)
    assert row["late_share"] == pytest.approx(12 / 50)
    stages = lag.stages.set_index("stage")
    assert list(stages.index) == ["gateway.accept", "stream.relay"]  # pipeline order; the worker's not here
    assert stages.loc["gateway.accept", "in_late_ms"] == pytest.approx(5.0)
    assert stages.loc["gateway.accept", "share_in_late"] == pytest.approx(5 / 20)
    assert stages.loc["stream.relay", "share_in_late"] == pytest.approx(2 / 10)


def test_no_sampled_loop_gives_empty_tables():
    lag = loop_lag(Source.of_tables(spans=SPANS.schema.empty_table()))
    assert lag.is_empty and len(lag.stages) == 0


def test_a_poke_just_before_the_tick_is_due_stands_in_for_it():
    """A traced callback running while nothing else waits takes the place of a tick due soon: the
    tick moves a period on. Before the window, or with callbacks waiting, it changes nothing."""
    rec = BufferedRecorder(InMemorySink(), instance_id=1, flush_interval_s=60)
    sampler = LoopLagSampler(rec, period_ns=10_000 * MS, defer_window_ns=5_000 * MS)  # no tick runs in the test

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        sampler.ensure_running()
        window = sampler.poke_from_ns
        sampler.poke(window - 1)  # too early: the tick stays
        moved = [sampler.num_deferred, sampler.poke_from_ns == window]
        loop.call_soon(lambda: None)  # another callback waits: the loop may yet run the tick late
        sampler.poke(window)
        moved += [sampler.num_deferred, sampler.poke_from_ns == window]
        await asyncio.sleep(0)  # (it ran)
        sampler.poke(window)
        moved += [sampler.num_deferred, sampler.poke_from_ns > window]
        sampler.close()
        sampler.poke(sampler.poke_from_ns)  # closed: nothing
        moved.append(sampler.num_deferred)
        return moved

    assert asyncio.run(main()) == [0, True, 0, True, 1, True, 1]
    assert sampler.num_ticks == 0
    rec.close()


def test_a_loop_blocked_between_pokes_is_still_recorded():
    """Pokes (a token written every half millisecond) move the ticks on while the loop is responsive;
    a 50 ms block stops the pokes, and the tick pending then runs late and is recorded."""
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=3, flush_interval_s=60)
    sampler = LoopLagSampler(rec, period_ns=5 * MS, min_lag_ns=2 * MS)

    async def streamer(until: float) -> None:
        while time.monotonic() < until:
            await asyncio.sleep(0.0005)
            t = time.monotonic_ns()
            if t >= sampler.poke_from_ns:
                sampler.poke(t)

    async def main() -> None:
        sampler.ensure_running()
        task = asyncio.create_task(streamer(time.monotonic() + 0.12))
        await asyncio.sleep(0.04)
        time.sleep(0.05)  # a callback that holds the loop for 50 ms
        await task
        sampler.close()

    asyncio.run(main())
    rec.flush()
    rows = sink.table(LOOP_LAGS.name).to_pylist()
    rec.close()
    assert rows, repr(sampler)
    longest = max(r[col.END_NS] - r[col.START_NS] for r in rows)
    assert longest >= 40 * MS  # the planted 50 ms, less the tick period it may have overlapped


def test_an_idle_server_is_not_sampled_until_its_next_request():
    """A tick that finds no request in flight is the last; the next request's ensure_running resumes."""
    rec = BufferedRecorder(InMemorySink(), instance_id=1, flush_interval_s=60)
    in_flight = []
    sampler = LoopLagSampler(rec, period_ns=5 * MS, is_idle=lambda: not in_flight)

    async def main() -> list[int]:
        sampler.ensure_running()
        await asyncio.sleep(0.05)
        idle_ticks = sampler.num_ticks  # the first tick found the server idle: no other ran
        in_flight.append("request")
        sampler.ensure_running()
        await asyncio.sleep(0.03)  # the tick due 5 ms after resuming ran before this sleep ended
        busy_ticks = sampler.num_ticks
        sampler.close()
        return [idle_ticks, busy_ticks]

    idle_ticks, busy_ticks = asyncio.run(main())
    assert idle_ticks == 1
    assert busy_ticks >= 2
    rec.close()


def _stream_tokens(sampler: LoopLagSampler, gap_s: float, until: float, *, block_at: float = 0.0,
                   block_s: float = 0.0):
    """A request in flight whose tokens are written every ``gap_s`` (each write pokes the sampler, as a
    traced write does); when ``block_at`` has passed, one callback holds the loop for ``block_s``."""

    async def stream() -> None:
        blocked = not block_s
        while time.monotonic() < until:
            await asyncio.sleep(gap_s)
            t = time.monotonic_ns()
            if t >= sampler.poke_from_ns:
                sampler.poke(t)
            if not blocked and time.monotonic() >= block_at:
                blocked = True
                await asyncio.sleep(gap_s / 4)  # after the write, between two tokens
                time.sleep(block_s)

    return stream()


def test_a_loop_idle_between_tokens_is_not_woken_by_ticks():
    """Tokens 40 ms apart (four periods) for 0.8 s: the loop waits between them. A tick at a fixed
    10 ms period runs 50 to 65 times here, each waking the waiting loop; the tick follows the writes
    and its period their rhythm, so it runs a few times while it learns it (4 to 15, the more the
    busier the machine: a late wake-up sets the period back)."""
    rec = BufferedRecorder(InMemorySink(), instance_id=1, flush_interval_s=60)
    sampler = LoopLagSampler(rec, period_ns=10 * MS, is_idle=lambda: False)

    async def main() -> None:
        sampler.ensure_running()
        await _stream_tokens(sampler, 0.04, time.monotonic() + 0.8)
        sampler.close()

    asyncio.run(main())
    rec.close()
    assert sampler.num_deferred >= 10, repr(sampler)  # the writes moved the tick
    assert sampler.num_ticks <= 20, repr(sampler)


def test_a_blocking_callback_between_slow_tokens_is_still_recorded():
    """The same stream, and after 0.5 s a callback that holds the loop for 150 ms: the tick pending
    (due at most the longest period after the last write) runs late and is recorded, inside the block."""
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=5, flush_interval_s=60)
    sampler = LoopLagSampler(rec, period_ns=10 * MS, max_period_ns=80 * MS, is_idle=lambda: False)
    block: list[int] = []

    async def main() -> None:
        sampler.ensure_running()
        start = time.monotonic()
        block.append(rec.clock())
        await _stream_tokens(sampler, 0.04, start + 1.0, block_at=start + 0.5, block_s=0.15)
        block.append(rec.clock())
        sampler.close()

    asyncio.run(main())
    rec.flush()
    rows = sink.table(LOOP_LAGS.name).to_pylist()
    rec.close()
    assert rows, repr(sampler)
    longest = max(rows, key=lambda r: r[col.END_NS] - r[col.START_NS])
    assert longest[col.END_NS] - longest[col.START_NS] >= 150 * MS - 80 * MS  # the block, less one longest period
    assert block[0] <= longest[col.START_NS] < longest[col.END_NS] <= block[1]
