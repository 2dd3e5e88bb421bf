"""AsyncEngine: streams equal offline generation; cancelling a consumer frees its blocks."""

from __future__ import annotations

import asyncio
import time

import pytest

from reference_server.engine import AsyncEngine, Engine, EngineConfig, EngineObserver
from reference_server.engine.async_engine import EngineStoppedError
from reference_server.model import SamplingParams

CONFIG = EngineConfig(model="tiny", block_size=4, num_device_blocks=64, max_num_batched_tokens=32, device="cpu")
SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = ["first prompt", "a second, longer prompt for the engine", "3"]


class SlowSteps(EngineObserver):
    """Sleeps 5 ms after every engine step, so that a long request is still running when a test
    cancels its consumer or stops the loop (on a busy machine the tiny model could finish it first)."""

    def on_step_end(self, event) -> None:
        time.sleep(0.005)


def slow_engine() -> Engine:
    engine = Engine(CONFIG)
    engine.add_observer(SlowSteps())
    return engine


async def collect(ae: AsyncEngine, rid: str, prompt: str, sampling=SAMPLING):
    return [d async for d in ae.generate(rid, prompt, sampling)]


def test_streams_equal_offline_generate():
    with Engine(CONFIG) as offline:
        expected = offline.generate(PROMPTS, SAMPLING)

    async def main():
        ae = AsyncEngine.from_config(CONFIG)
        await ae.start()
        try:
            return await asyncio.gather(*(collect(ae, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        finally:
            await ae.stop()
            ae.engine.close()

    streams = asyncio.run(main())
    for deltas, completion in zip(streams, expected):
        assert tuple(d.token_id for d in deltas) == completion.token_ids
        assert "".join(d.text for d in deltas) == completion.text
        assert [d.index for d in deltas] == list(range(8))
        assert [d.finish_reason for d in deltas] == [None] * 7 + ["length"]


async def drain_then_check(ae: AsyncEngine):
    """Run one short request to completion: by then the loop has applied earlier aborts."""
    await collect(ae, "probe", "probe", SamplingParams(max_tokens=1, ignore_eos=True))
    return ae.engine.stats()


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_cancelling_the_consumer_aborts_and_frees_blocks(how):
    async def main():
        ae = AsyncEngine(slow_engine())
        await ae.start()
        try:
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            if how == "aclose":
                stream = ae.generate("long", "x" * 40, long)
                got = [await stream.__anext__(), await stream.__anext__()]
                await stream.aclose()
            else:
                got, first = [], asyncio.Event()

                async def consume():
                    async for d in ae.generate("long", "x" * 40, long):
                        got.append(d)
                        first.set()

                task = asyncio.create_task(consume())
                await first.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            stats = await drain_then_check(ae)
            return got, stats
        finally:
            await ae.stop()
            ae.engine.close()

    got, stats = asyncio.run(main())
    assert got and got[-1].finish_reason is None
    assert stats.num_requests_aborted == 1 and stats.num_requests_finished == 1
    assert stats.num_blocks_used == (0, 0, 0) and stats.num_running == stats.num_waiting == 0


def test_bad_input_and_duplicates_raise_value_error():
    async def main():
        ae = AsyncEngine(Engine(CONFIG))
        await ae.start()
        try:
            with pytest.raises(ValueError, match="prompt is empty"):
                await ae.generate("bad", "", SAMPLING).__anext__()
            with pytest.raises(ValueError, match="unknown sampling option"):
                await ae.generate("bad", "hi", {"bogus": 1}).__anext__()
            stream = ae.generate("dup", "hello there", SamplingParams(max_tokens=50, ignore_eos=True))
            await stream.__anext__()
            with pytest.raises(ValueError, match="duplicate request_id 'dup'"):
                await ae.generate("dup", "again", SAMPLING).__anext__()
            await stream.aclose()
        finally:
            await ae.stop()
            ae.engine.close()

    asyncio.run(main())


def test_idle_loop_does_not_step_and_stop_ends_open_streams():
    async def main():
        ae = AsyncEngine(slow_engine())
        await ae.start()
        await collect(ae, "warm", "warm up")
        steps = ae.engine.stats().num_steps
        await asyncio.sleep(0.05)  # nothing queued: the loop must sleep, not step
        idle_steps = ae.engine.stats().num_steps - steps
        stream = ae.generate("open", "y" * 30, SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        await ae.stop()
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        stats = ae.engine.stats()
        ae.engine.close()
        with pytest.raises(EngineStoppedError, match="not started"):
            await ae.generate("late", "hi", SAMPLING).__anext__()
        return idle_steps, stats

    idle_steps, stats = asyncio.run(main())
    assert idle_steps == 0
    assert stats.num_requests_aborted == 1 and stats.num_blocks_used == (0, 0, 0)
