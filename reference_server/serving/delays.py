"""Delay injection: plant a known, real delay at a named stage of serving.

A spec string (from the CLI or a config file) names stages and how long to sleep there::

    tokenize=5ms,decode_step=2ms~8ms,stream_send=250us

Each entry is ``stage=DURATION`` (a fixed delay) or ``stage=LOW~HIGH`` (uniformly random
in ``[LOW, HIGH]``, drawn per occurrence). Durations are a number with a unit: ``ns``,
``us``, ``ms`` or ``s``. Entries are separated by commas; whitespace is ignored; an empty
spec means no delays. A stage may appear once.

Stages, and which process applies each one (where the sleep happens):

============  ==========  ===================================================================
stage         applied by  point
============  ==========  ===================================================================
tokenize      gateway     inside the tokenize interval (chat template + ``encode``)
route         gateway     before handing the request to the backend (inside the route interval)
schedule      workers     once per admission, as the engine admits a request (its schedule.queue time)
kv_transfer   workers     on each KV transfer from a prefill to a decode worker
decode_step   workers     before every engine step that decodes tokens
prefill_token workers     before every engine step that computes prompt tokens, once per such token (a
                          prefill cost that grows with the prompt, as a larger model's does)
detokenize    gateway     per output token, while turning the backend's token into the chunk
stream_send   gateway     per chunk, just before it is written to the client stream
============  ==========  ===================================================================

Workers (``reference_server.serving`` cluster code) receive the same spec string and parse
it with :meth:`DelayConfig.parse`; ``str(config)`` gives back a spec that parses to the
same delays, for passing on a command line. The three engine stages are planted inside the
engine's step by :func:`plant_engine_delays`.

Every delay is a real wait of the drawn length, measured on ``time.monotonic_ns()``: nothing
is simulated, so any profiler sees it where it was planted. :meth:`DelayConfig.delay_sync`
sleeps (``time.sleep``, accurate to tens of microseconds on Linux). :meth:`DelayConfig.delay`
sleeps on the event loop until the last :data:`SPIN_BELOW_NS`, which the loop's timers
cannot resolve (epoll waits in whole milliseconds: ``asyncio.sleep(300e-6)`` takes over a
millisecond); it spends those yielding to other tasks in a loop, so it ends within tens of
microseconds of its deadline without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reference_server.engine import Engine

__all__ = ["DELAY_STAGES", "DelayConfig", "StageDelay", "parse_duration_ns", "plant_engine_delays"]

DELAY_STAGES: tuple[str, ...] = (
    "tokenize", "route", "schedule", "kv_transfer", "decode_step", "prefill_token", "detokenize", "stream_send",
)
"""Stage names a spec may use (see the module docstring for where each applies)."""

_UNIT_NS = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ns|us|ms|s)\s*$")
_MAX_DELAY_NS = 3_600 * 1_000_000_000  # one hour: anything longer is surely a typo
SPIN_BELOW_NS = 2_000_000
"""The last part of an event-loop delay, spent yielding rather than on a timer (ns)."""


def parse_duration_ns(text: str) -> int:
    """``"2.5ms"`` -> 2_500_000. Raises ``ValueError`` for a missing unit, a negative or
    non-numeric value, or more than an hour."""
    match = _DURATION.match(text)
    if match is None:
        units = ", ".join(_UNIT_NS)
        raise ValueError(f"bad duration {text.strip()!r}: expected a non-negative number with a unit ({units}), "
                         "e.g. 5ms")
    value_ns = round(float(match.group(1)) * _UNIT_NS[match.group(2)])
    if value_ns > _MAX_DELAY_NS:
        raise ValueError(f"duration {text.strip()!r} is longer than one hour")
    return value_ns


@dataclass(frozen=True, slots=True)
class StageDelay:
    """A delay of ``low_ns`` (fixed, when ``high_ns == low_ns``) or uniform in
    ``[low_ns, high_ns]``. Nanoseconds."""

    low_ns: int
    high_ns: int

    def __post_init__(self) -> None:
        if self.low_ns < 0 or self.high_ns < self.low_ns:
            raise ValueError(f"delay range must satisfy 0 <= low <= high, got {self.low_ns}ns~{self.high_ns}ns")

    @property
    def is_fixed(self) -> bool:
        return self.low_ns == self.high_ns

    def spec(self) -> str:
        """This delay as spec text (``5000000ns`` or ``2000000ns~8000000ns``)."""
        return f"{self.low_ns}ns" if self.is_fixed else f"{self.low_ns}ns~{self.high_ns}ns"


@dataclass(frozen=True, slots=True)
class DelayConfig:
    """Which stages sleep and for how long. Immutable; safe to share between threads
    (the random source is guarded by a lock). ``DelayConfig()`` delays nothing.

    Call sites do ``if delays.has(stage): await delays.delay(stage)`` or simply
    ``await delays.delay(stage)`` (a no-op, without a sleep, for an absent stage).
    """

    stages: Mapping[str, StageDelay] = field(default_factory=dict)
    seed: int | None = None  # for random ranges; None = nondeterministic
    _rng: random.Random = field(init=False, repr=False, compare=False)
    _lock: threading.Lock = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for stage in self.stages:
            _check_stage(stage)
        object.__setattr__(self, "stages", dict(self.stages))
        object.__setattr__(self, "_rng", random.Random(self.seed))
        object.__setattr__(self, "_lock", threading.Lock())

    @classmethod
    def parse(cls, spec: str | None, *, seed: int | None = None) -> DelayConfig:
        """Parse a spec string (see the module docstring). ``None`` or ``""`` gives no
        delays. Raises ``ValueError`` naming the bad entry: unknown stage, missing ``=``,
        bad duration, ``low > high``, or a stage given twice."""
        if spec is not None and not isinstance(spec, str):
            raise ValueError(f"delay spec must be a string, got {type(spec).__name__}")
        if spec is None or not spec.strip():
            return cls(seed=seed)
        stages: dict[str, StageDelay] = {}
        for entry in spec.split(","):
            if not entry.strip():
                continue
            stage, delay = _parse_entry(entry)
            if stage in stages:
                raise ValueError(f"delay spec names stage {stage!r} twice")
            stages[stage] = delay
        return cls(stages, seed=seed)

    def __str__(self) -> str:
        return ",".join(f"{stage}={delay.spec()}" for stage, delay in self.stages.items())

    def __bool__(self) -> bool:
        return bool(self.stages)

    def has(self, stage: str) -> bool:
        """Whether ``stage`` has a delay planted (``ValueError`` for an unknown stage name)."""
        _check_stage(stage)
        return stage in self.stages

    def draw_ns(self, stage: str) -> int:
        """The length of the next delay at ``stage`` in ns (0 when none is planted)."""
        delay = self.stages.get(stage)
        if delay is None:
            _check_stage(stage)
            return 0
        if delay.is_fixed:
            return delay.low_ns
        with self._lock:
            return self._rng.randint(delay.low_ns, delay.high_ns)

    async def delay(self, stage: str) -> int:
        """Sleep (without blocking the event loop) for the stage's delay; return the
        drawn length in ns. Returns 0 at once when nothing is planted at ``stage``.
        The sleep lasts at least the drawn length on ``time.monotonic_ns()``."""
        length_ns = self.draw_ns(stage)
        if length_ns <= 0:
            return 0
        deadline_ns = time.monotonic_ns() + length_ns
        while (remaining_ns := deadline_ns - time.monotonic_ns()) > SPIN_BELOW_NS:
            await asyncio.sleep((remaining_ns - SPIN_BELOW_NS) / 1e9)
        while time.monotonic_ns() < deadline_ns:
            await asyncio.sleep(0)  # yields to the loop's other tasks; a timer would oversleep
        return length_ns

    def delay_sync(self, stage: str, *, times: int = 1) -> int:
        """Blocking version of :meth:`delay` for threads that are not an event loop
        (the engine thread, a transfer thread): one draw, slept ``times`` over (a per-token
        delay for ``times`` tokens). Returns the slept length in ns."""
        length_ns = self.draw_ns(stage) * max(times, 0)
        if length_ns <= 0:
            return 0
        deadline_ns = time.monotonic_ns() + length_ns
        while (remaining_ns := deadline_ns - time.monotonic_ns()) > 0:
            time.sleep(remaining_ns / 1e9)
        return length_ns


def plant_engine_delays(engine: Engine, delays: DelayConfig) -> None:
    """Plant the engine stages' delays inside ``engine``'s step: "schedule" once per
    admission, as the scheduler moves a request to running (after its prefix-cache
    lookup, before its first compute: the request's schedule.queue time), "decode_step"
    before a forward pass that decodes and "prefill_token" before one that computes prompt
    tokens, once per such token (both inside the pass's compute interval). A chunk of one
    token past position 0 is a decode; every other chunk's tokens are prompt tokens.
    Instance attributes shadow the scheduler's and runner's methods; call once per
    engine, before it runs. Does nothing when no engine stage is planted."""
    if not any(delays.has(stage) for stage in ("schedule", "decode_step", "prefill_token")):
        return
    start_running, execute = engine.scheduler.start_running, engine.runner.execute

    def delayed_start_running(seq: Any) -> None:
        delays.delay_sync("schedule")
        start_running(seq)

    def delayed_execute(chunks: Any) -> Any:
        decodes = [len(c.token_ids) == 1 and c.start_pos > 0 for c in chunks]
        if any(decodes):
            delays.delay_sync("decode_step")
        prompt_tokens = sum(len(c.token_ids) for c, is_decode in zip(chunks, decodes) if not is_decode)
        if prompt_tokens:
            delays.delay_sync("prefill_token", times=prompt_tokens)
        return execute(chunks)

    engine.scheduler.start_running = delayed_start_running  # type: ignore[method-assign]
    engine.runner.execute = delayed_execute  # type: ignore[method-assign]


def _check_stage(stage: str) -> None:
    if stage not in DELAY_STAGES:
        raise ValueError(f"unknown delay stage {stage!r}; known stages: {', '.join(DELAY_STAGES)}")


def _parse_entry(entry: str) -> tuple[str, StageDelay]:
    if "=" not in entry:
        raise ValueError(f"bad delay entry {entry.strip()!r}: expected stage=DURATION or stage=LOW~HIGH, e.g. "
                         "tokenize=5ms or decode_step=2ms~8ms")
    stage, _, value = entry.partition("=")
    stage = stage.strip()
    _check_stage(stage)
    low_text, tilde, high_text = value.partition("~")
    try:
        low_ns = parse_duration_ns(low_text)
        high_ns = parse_duration_ns(high_text) if tilde else low_ns
    except ValueError as exc:
        raise ValueError(f"delay for stage {stage!r}: {exc}") from None
    if high_ns < low_ns:
        raise ValueError(f"delay for stage {stage!r}: low {low_text.strip()} is greater than high {high_text.strip()}")
    return stage, StageDelay(low_ns, high_ns)
