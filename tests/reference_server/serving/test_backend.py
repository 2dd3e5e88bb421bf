"""LocalBackend: the Backend contract on one in-process engine."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from reference_server.engine import Engine, EngineConfig
from reference_server.model import SamplingParams
from reference_server.serving.backend import BackendUnavailable, GenerateRequest, LocalBackend
from reference_server.serving.delays import DelayConfig
from reference_server.serving.worker_hooks import WorkerObserver

torch.set_num_threads(1)
CONFIG = EngineConfig(model="tiny", block_size=4, num_device_blocks=64, device="cpu")
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def request(backend, rid: str, prompt: str, sampling: SamplingParams = GREEDY) -> GenerateRequest:
    now = time.monotonic_ns()
    return GenerateRequest(rid, tuple(backend.tokenizer.encode(prompt)), sampling, "default", "interactive", now,
                           now + 500_000_000)


async def with_backend(fn, delays: DelayConfig | None = None):
    backend = LocalBackend(CONFIG, delays=delays)
    await backend.start()
    try:
        return await fn(backend)
    finally:
        await backend.stop()


async def wait_for_no_used_blocks(backend) -> tuple[int, int, int]:
    for _ in range(200):
        used = backend.stats().num_blocks_used
        if used == (0, 0, 0):
            break
        await asyncio.sleep(0.01)
    return backend.stats().num_blocks_used


def test_stream_matches_the_engine_token_for_token():
    prompt = "Backends stream one event per token."
    with Engine(CONFIG) as engine:
        expected = engine.generate([prompt], GREEDY)[0]

    async def go(backend):
        return [e async for e in backend.generate(request(backend, "r1", prompt))]

    events = asyncio.run(with_backend(go))
    assert [e.token_id for e in events] == list(expected.token_ids)
    assert [e.index for e in events] == list(range(10))
    assert "".join(e.text for e in events) == expected.text
    assert [e.finish_reason for e in events] == [None] * 9 + ["length"]
    assert {e.instance for e in events} == {"colocated-0"}
    assert {e.num_prompt_tokens for e in events} == {len(expected.prompt_token_ids)}


def test_bad_input_raises_value_error_on_first_next():
    async def go(backend):
        too_long = GenerateRequest("r", (1,) * 300, GREEDY, "default", "interactive", 0, 0)
        with pytest.raises(ValueError, match="context window"):
            await backend.generate(too_long).__anext__()
        unknown_tenant = GenerateRequest("r2", (1, 2), GREEDY, "nobody", "interactive", 0, 0)
        with pytest.raises(ValueError, match="unknown tenant"):
            await backend.generate(unknown_tenant).__anext__()
        return [e async for e in backend.generate(request(backend, "ok", "still serving"))]

    assert len(asyncio.run(with_backend(go))) == 10


def test_closing_the_stream_aborts_and_frees_blocks():
    # 5 ms before every decode step: the 100-token requests are still running when the streams close
    async def go(backend):
        streams = [backend.generate(request(backend, f"r{i}", f"request {i} " * 8,
                                            SamplingParams(max_tokens=100, ignore_eos=True))) for i in range(4)]
        for s in streams:
            await s.__anext__()
        assert backend.stats().num_blocks_used[0] > 0
        for s in streams:
            await s.aclose()
        return await wait_for_no_used_blocks(backend), backend.stats().instances[0]

    used, inst = asyncio.run(with_backend(go, DelayConfig.parse("decode_step=5ms")))
    assert used == (0, 0, 0)
    assert inst.num_running == 0 and inst.num_waiting == 0


def test_route_events_and_unstarted_backend():
    routes = []

    class Obs(WorkerObserver):
        def on_route(self, event):
            routes.append(event)

    async def go(backend):
        backend.add_observer(Obs())
        return [e async for e in backend.generate(request(backend, "r1", "route me"))]

    asyncio.run(with_backend(go))
    assert [(r.request_id, r.instance, r.policy) for r in routes] == [("r1", "colocated-0", "local")]

    async def unstarted():
        backend = LocalBackend(CONFIG)
        try:
            with pytest.raises(BackendUnavailable, match="not started"):
                await backend.generate(request(backend, "r", "x")).__anext__()
        finally:
            await backend.stop()

    asyncio.run(unstarted())
