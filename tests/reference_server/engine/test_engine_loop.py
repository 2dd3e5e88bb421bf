"""EngineLoop: prefill with handoff on one loop, import and decode on another; errors reach sinks."""

from __future__ import annotations

import queue

import torch

from reference_server.engine import Engine, EngineConfig
from reference_server.engine.engine_loop import EngineLoop, EngineStoppedError
from reference_server.model import SamplingParams

torch.set_num_threads(1)
CONFIG = EngineConfig(model="tiny", block_size=4, num_device_blocks=64, device="cpu")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = "Prefill here, decode there."


class Sink:
    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def on_output(self, output):
        self.items.put(("out", output))

    def on_handoff(self, state):
        self.items.put(("handoff", state))

    def on_error(self, exc):
        self.items.put(("error", exc))

    def take(self, n: int) -> list:
        return [self.items.get(timeout=30) for _ in range(n)]


def test_handoff_between_two_loops_gives_the_colocated_tokens():
    with Engine(CONFIG) as ref:
        expected = list(ref.generate([PROMPT], GREEDY)[0].token_ids)
    prefill, decode = EngineLoop(Engine(CONFIG)), EngineLoop(Engine(CONFIG))
    prefill.start()
    decode.start()
    try:
        sink = Sink()
        prefill.submit(prefill.engine.prepare_request("r", PROMPT, GREEDY), sink, handoff=True)
        (k1, first), (k2, state) = sink.take(2)
        assert (k1, k2) == ("out", "handoff") and first.token_index == 0
        dsink = Sink()
        decode.submit_prefilled(decode.engine.prepare_request("r", PROMPT, GREEDY), state.output_token_ids,
                                state.data, dsink)
        rest = [o for _, o in dsink.take(7)]
        assert [first.token_id] + [o.token_id for o in rest] == expected
        assert [o.token_index for o in rest] == list(range(1, 8))
        used = prefill.call(lambda e: e.block_manager.usage().num_used).result(timeout=10)
        assert used == (0, 0, 0)
    finally:
        prefill.stop()
        decode.stop()
        prefill.engine.close()
        decode.engine.close()


def test_bad_import_and_duplicate_id_are_reported_to_their_sinks():
    loop = EngineLoop(Engine(CONFIG))
    loop.start()
    try:
        sink, dup = Sink(), Sink()
        loop.submit(loop.engine.prepare_request("a", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)), sink)
        loop.submit(loop.engine.prepare_request("a", PROMPT, GREEDY), dup)
        (kind, exc), = dup.take(1)
        assert kind == "error" and isinstance(exc, ValueError) and "duplicate request_id 'a'" in str(exc)
        assert [o.token_index for _, o in sink.take(3)] == [0, 1, 2]  # the first "a" is untouched
        loop.submit_prefilled(loop.engine.prepare_request("b", PROMPT, GREEDY), (5,), b"wrong size", sink)
        (kind, exc), = sink.take(1)
        assert kind == "error" and "bytes" in str(exc)
    finally:
        loop.stop()
        loop.engine.close()


def test_stop_ends_open_requests_with_engine_stopped_error_and_frees_blocks():
    loop = EngineLoop(Engine(CONFIG))
    loop.start()
    sink = Sink()
    loop.submit(loop.engine.prepare_request("long", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True)), sink)
    sink.take(1)
    loop.stop()
    try:
        items = [sink.items.get(timeout=30)]
        while items[-1][0] == "out":
            items.append(sink.items.get(timeout=30))
        kind, exc = items[-1]
        assert kind == "error" and isinstance(exc, EngineStoppedError) and not loop.is_running
        stats = loop.engine.stats()
        assert stats.num_requests_aborted == 1 and stats.num_blocks_used == (0, 0, 0)
    finally:
        loop.engine.close()


def test_a_failing_step_errors_open_requests_and_reports_fatal():
    fatal = queue.Queue()
    loop = EngineLoop(Engine(CONFIG), on_fatal=fatal.put)

    def broken(chunks):
        raise RuntimeError("device lost")

    loop.engine.runner.execute = broken  # type: ignore[method-assign]
    loop.start()
    try:
        sink = Sink()
        loop.submit(loop.engine.prepare_request("a", PROMPT, GREEDY), sink)
        (kind, exc), = sink.take(1)
        assert kind == "error" and isinstance(exc, EngineStoppedError) and "device lost" in str(exc)
        assert "device lost" in str(fatal.get(timeout=30))
        assert isinstance(loop.error, RuntimeError) and exc.__cause__ is loop.error
    finally:
        loop.stop()
        loop.engine.close()
