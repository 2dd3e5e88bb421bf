from __future__ import annotations

import asyncio
import queue
import time

import pytest

from reference_server.engine import Engine, EngineConfig, EngineLoop
from reference_server.model import SamplingParams
from reference_server.serving.delays import (
    DELAY_STAGES,
    DelayConfig,
    StageDelay,
    parse_duration_ns,
    plant_engine_delays,
)


@pytest.mark.parametrize(("text", "expected_ns"), [
    ("5ms", 5_000_000), ("250us", 250_000), ("1.5s", 1_500_000_000), ("7ns", 7), (" 0ms ", 0), (".5ms", 500_000),
])
def test_parse_duration_units(text: str, expected_ns: int) -> None:
    assert parse_duration_ns(text) == expected_ns


@pytest.mark.parametrize("text", ["5", "ms", "-1ms", "5 minutes", "abc", "", "2h", "4000s"])
def test_parse_duration_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration_ns(text)


def test_parse_fixed_and_random_stages() -> None:
    cfg = DelayConfig.parse("tokenize=5ms, decode_step=2ms~8ms,stream_send=250us")
    assert cfg.stages == {
        "tokenize": StageDelay(5_000_000, 5_000_000),
        "decode_step": StageDelay(2_000_000, 8_000_000),
        "stream_send": StageDelay(250_000, 250_000),
    }
    assert cfg.has("tokenize") and not cfg.has("route")
    assert bool(cfg)


@pytest.mark.parametrize("spec", [None, "", "  ", ","])
def test_empty_spec_means_no_delays(spec: str | None) -> None:
    cfg = DelayConfig.parse(spec)
    assert not cfg
    assert cfg.draw_ns("tokenize") == 0


@pytest.mark.parametrize(("spec", "message"), [
    ("tokenise=5ms", "unknown delay stage 'tokenise'"),
    ("tokenize", "expected stage=DURATION"),
    ("tokenize=5", "bad duration"),
    ("decode_step=8ms~2ms", "greater than high"),
    ("route=1ms,route=2ms", "twice"),
    ("route=1ms~", "bad duration"),
])
def test_bad_specs_raise_clear_value_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DelayConfig.parse(spec)


def test_non_string_spec_is_rejected() -> None:
    with pytest.raises(ValueError, match="must be a string"):
        DelayConfig.parse(5)  # type: ignore[arg-type]


def test_str_round_trips_through_parse() -> None:
    cfg = DelayConfig.parse("schedule=1.5ms,kv_transfer=1ms~3ms")
    again = DelayConfig.parse(str(cfg))
    assert again.stages == cfg.stages


def test_random_draws_stay_in_range_and_follow_the_seed() -> None:
    a = DelayConfig.parse("decode_step=2ms~8ms", seed=7)
    b = DelayConfig.parse("decode_step=2ms~8ms", seed=7)
    draws = [a.draw_ns("decode_step") for _ in range(200)]
    assert all(2_000_000 <= d <= 8_000_000 for d in draws)
    assert len(set(draws)) > 100  # really random, not a constant
    assert draws == [b.draw_ns("decode_step") for _ in range(200)]


def test_unknown_stage_at_a_call_site_raises() -> None:
    cfg = DelayConfig.parse("tokenize=1ms")
    with pytest.raises(ValueError, match="unknown delay stage"):
        cfg.draw_ns("tokenizer")
    with pytest.raises(ValueError, match="unknown delay stage"):
        cfg.has("nope")


def test_every_documented_stage_parses() -> None:
    cfg = DelayConfig.parse(",".join(f"{stage}=1us" for stage in DELAY_STAGES))
    assert set(cfg.stages) == set(DELAY_STAGES)


def test_delay_sync_sleeps_at_least_the_planted_length() -> None:
    cfg = DelayConfig.parse("kv_transfer=20ms")
    start = time.monotonic_ns()
    drawn = cfg.delay_sync("kv_transfer")
    elapsed = time.monotonic_ns() - start
    assert drawn == 20_000_000
    assert elapsed >= 20_000_000
    assert cfg.delay_sync("route") == 0


def test_async_delay_sleeps_at_least_the_drawn_length_without_blocking_the_loop() -> None:
    cfg = DelayConfig.parse("route=5ms~15ms", seed=3)

    async def main() -> tuple[int, int, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        start = time.monotonic_ns()
        drawn = await cfg.delay("route")
        elapsed = time.monotonic_ns() - start
        task.cancel()
        return drawn, elapsed, ticks

    drawn, elapsed, ticks = asyncio.run(main())
    assert 5_000_000 <= drawn <= 15_000_000
    assert elapsed >= drawn
    assert ticks > 0  # the loop kept running other tasks during the delay


class _Outputs:
    """An EngineLoop sink collecting outputs (engine thread) for the test thread."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def on_output(self, output):
        self.items.put(output)

    def on_handoff(self, state):
        self.items.put(RuntimeError("unexpected handoff"))

    def on_error(self, exc):
        self.items.put(exc)


def test_planted_decode_step_delay_is_slept_before_each_decode_step() -> None:
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=64, device="cpu"))
    plant_engine_delays(engine, DelayConfig.parse("decode_step=20ms"))
    loop = EngineLoop(engine)
    loop.start()
    try:
        sink = _Outputs()
        start = time.monotonic()
        loop.submit(engine.prepare_request("a", "Prefill here, decode there.",
                                           SamplingParams(max_tokens=3, ignore_eos=True)), sink)
        outs = [sink.items.get(timeout=30) for _ in range(3)]
        assert time.monotonic() - start >= 0.04  # two decode steps of at least 20 ms each
        assert [o.token_index for o in outs] == [0, 1, 2]
    finally:
        loop.stop()
        engine.close()


def test_planted_prefill_token_delay_is_slept_once_per_prompt_token_a_step_computes() -> None:
    """4 ms per prompt token, a 6-token step budget: each step that computes prompt tokens sleeps at least 4 ms per
    token before its forward pass (chunks of 6, 6, 6 and the rest of the prompt)."""
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=64, device="cpu",
                                 max_num_batched_tokens=6))
    entered: list[tuple[int, int]] = []  # (prompt tokens of the pass, ns from the planted wrapper to the pass)
    execute = engine.runner.execute
    engine.runner.execute = lambda chunks: (entered.append((_prompt_tokens(chunks), time.monotonic_ns())),  # type: ignore[method-assign]
                                            execute(chunks))[1]
    plant_engine_delays(engine, DelayConfig.parse("prefill_token=4ms"))
    planted = engine.runner.execute
    called: list[int] = []
    engine.runner.execute = lambda chunks: (called.append(time.monotonic_ns()), planted(chunks))[1]  # type: ignore[method-assign]
    loop = EngineLoop(engine)
    loop.start()
    try:
        sink = _Outputs()
        request = engine.prepare_request("a", "x" * 20, SamplingParams(max_tokens=3, ignore_eos=True))
        loop.submit(request, sink)
        outs = [sink.items.get(timeout=30) for _ in range(3)]
        assert [o.token_index for o in outs] == [0, 1, 2]
    finally:
        loop.stop()
        engine.close()
    prompt_steps = [(n, t - t0) for (n, t), t0 in zip(entered, called) if n]
    assert [n for n, _ in prompt_steps][:3] == [6, 6, 6] and sum(n for n, _ in prompt_steps) > 18, prompt_steps
    assert all(slept >= n * 4_000_000 for n, slept in prompt_steps), prompt_steps


def _prompt_tokens(chunks) -> int:
    return sum(len(c.token_ids) for c in chunks if not (len(c.token_ids) == 1 and c.start_pos > 0))


def test_a_sub_millisecond_async_delay_sleeps_what_it_says() -> None:
    """300 us on the event loop: the loop's timers wait whole milliseconds (epoll), so a plain
    ``asyncio.sleep`` took over 1 ms. A loaded machine only ever adds time, so the quickest of
    twenty tries shows what the injector itself does."""
    cfg = DelayConfig.parse("stream_send=300us")

    async def tries() -> list[int]:
        out = []
        for _ in range(20):
            start = time.monotonic_ns()
            await cfg.delay("stream_send")
            out.append(time.monotonic_ns() - start)
        return out

    elapsed = asyncio.run(tries())
    assert min(elapsed) >= 300_000
    assert min(elapsed) < 800_000, sorted(elapsed)[:5]


class _CountingDelays(DelayConfig):
    """Counts the synchronous delays taken per stage."""

    def __init__(self, spec: str) -> None:
        parsed = DelayConfig.parse(spec)
        super().__init__(parsed.stages)
        object.__setattr__(self, "taken", {})

    def delay_sync(self, stage: str, *, times: int = 1) -> int:
        self.taken[stage] = self.taken.get(stage, 0) + 1
        return super().delay_sync(stage, times=times)


def test_the_schedule_delay_is_taken_once_per_admission_not_per_step() -> None:
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=64, device="cpu"))
    delays = _CountingDelays("schedule=1ms")
    plant_engine_delays(engine, delays)
    loop = EngineLoop(engine)
    loop.start()
    try:
        sinks = [_Outputs(), _Outputs()]
        for i, sink in enumerate(sinks):
            loop.submit(engine.prepare_request(f"r{i}", "Admit me once.", SamplingParams(max_tokens=6, ignore_eos=True)),
                        sink)
        for sink in sinks:
            outs = [sink.items.get(timeout=30) for _ in range(6)]
            assert [o.token_index for o in outs] == list(range(6))
    finally:
        loop.stop()
        engine.close()
    assert delays.taken["schedule"] == 2  # two admissions, at least six steps
