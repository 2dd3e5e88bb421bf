"""Small real runs of the reference engine for the what-if tests: the engine in this process, traced by
``tokentrace.instrument`` into a store, fed a seeded open-loop workload (Poisson arrivals stamped at their
scheduled times, as a gateway would stamp them) and stepped until every request finished.

``device_ms=(fixed, per_token)``: each forward pass lasts ``fixed + per_token x tokens`` ms (the pass itself
runs, then the rest of that time is slept), as on a dedicated accelerator that takes that long whatever the
host's other processes do; ``device_ms=f`` (a function of the pass's sequences and tokens, in ms) gives any
other shape, such as a step time that grows less than linearly with the batch. The tiny model's own
CPU passes take about a millisecond, which the test machine's other processes stretch by several times
from one run to the next; with the sleep, the scheduler, block manager, tracers and store are all real and
the step time is the device's, so a run measures the scheduling the simulator models rather than the
machine's load."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

import torch

import tokentrace
from reference_server.engine.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.model import SamplingParams

WORKLOAD_SEED = 11


def workload(num_requests: int, rate_rps: float, seed: int = WORKLOAD_SEED) -> list[tuple[float, str, int]]:
    """(arrival offset s, prompt, output tokens) per request: prompts of 16-96 bytes, 4-24 output tokens."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(16, 96)))
        out.append((t, prompt, rng.randint(4, 24)))
        t += rng.expovariate(rate_rps)
    return out


def engine_run(store: Path, run_id: str, *, num_requests: int = 40, rate_rps: float = 30.0, model: str = "tiny",
               device_ms: tuple[float, float] | Callable[[int, int], float] | None = None,
               **config: object) -> None:
    """Serve the workload on one engine built from ``config`` (EngineConfig fields), traced into ``run_id``."""
    torch.set_num_threads(1)
    _warm_up(model)
    engine = Engine(EngineConfig(model=model, device="cpu", **config))
    if device_ms is not None:
        _plant_device_time(engine, device_ms if callable(device_ms) else _linear(*device_ms))
    plan = workload(num_requests, rate_rps)
    with tokentrace.instrument(engine, store=store, run=run_id):
        t0 = time.monotonic_ns()
        pending = list(enumerate(plan))
        while pending or engine.has_unfinished():
            now = time.monotonic_ns()
            while pending and t0 + int(pending[0][1][0] * 1e9) <= now:
                i, (offset, prompt, out) = pending.pop(0)
                engine.add_request(f"{run_id}-{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                                   arrival_ns=t0 + int(offset * 1e9))
            if engine.has_unfinished():
                engine.step()
            elif pending:
                time.sleep(max(0.0, (t0 + int(pending[0][1][0] * 1e9) - time.monotonic_ns()) / 1e9))


_warm: set[str] = set()


def _warm_up(model: str) -> None:
    """Serve two requests untraced, once per process and model: the first passes compile the decode kernel,
    which would make whichever run comes first slower than the others."""
    if model in _warm:
        return
    engine = Engine(EngineConfig(model=model, device="cpu"))
    for i in range(2):
        engine.add_request(f"warm-{i}", "warm up the kernels " * (i + 1), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    _warm.add(model)


def _linear(fixed_ms: float, per_token_ms: float) -> Callable[[int, int], float]:
    return lambda num_seqs, num_tokens: fixed_ms + per_token_ms * num_tokens


def _plant_device_time(engine: Engine, device_ms: Callable[[int, int], float]) -> None:
    execute = engine.runner.execute

    def on_device(chunks):
        num_tokens = sum(len(c.token_ids) for c in chunks)
        deadline = time.monotonic_ns() + int(device_ms(len(chunks), num_tokens) * 1e6)
        out = execute(chunks)  # the host's own work runs inside the device time, as an accelerator's launch would
        while (left := deadline - time.monotonic_ns()) > 0:
            time.sleep(left / 1e9)
        return out

    engine.runner.execute = on_device
