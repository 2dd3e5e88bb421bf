"""The engine's typed observer fan-out: direct calls in attach order, errors counted, never raised."""

from __future__ import annotations

import inspect

import pytest

from reference_server.engine.hooks import EngineObserver, EngineObserverProtocol, StepStart, TokenEmitted
from reference_server.engine.observers import ObserverFanOut


class _Log(EngineObserver):
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def on_step_start(self, event: StepStart) -> None:
        self.log.append((self.name, event.step))


class _Broken(EngineObserver):
    def on_step_start(self, event: StepStart) -> None:
        raise RuntimeError("observer bug")


class _Partial:
    """Duck-typed: implements one hook only; the others are missing (counted when called)."""

    def on_token_emitted(self, event: TokenEmitted) -> None:
        pass


def test_the_fan_out_implements_every_hook_of_the_protocol():
    hooks = {name for name, _ in inspect.getmembers(EngineObserverProtocol, inspect.isfunction)
             if name.startswith("on_")}
    assert len(hooks) == 15
    assert all(callable(getattr(ObserverFanOut, name, None)) for name in hooks)


def test_calls_in_attach_order_count_errors_and_keep_going():
    log: list = []
    fan = ObserverFanOut()
    assert not fan
    first, broken, last = _Log("first", log), _Broken(), _Log("last", log)
    for observer in (first, broken, last):
        fan.add(observer)
    event = StepStart(step=4, start_ns=10)
    fan.on_step_start(event)
    fan.on_step_start(event)
    assert log == [("first", 4), ("last", 4)] * 2
    assert fan.num_errors == 2 and len(fan) == 3 and broken in fan
    fan.remove(broken)
    fan.on_step_start(event)
    assert fan.num_errors == 2 and list(fan) == [first, last]
    with pytest.raises(ValueError, match="not attached"):
        fan.remove(broken)


def test_a_missing_hook_is_counted_as_an_error():
    fan = ObserverFanOut()
    fan.add(_Partial())  # type: ignore[arg-type]  # what a type checker refuses
    fan.on_step_start(StepStart(step=0, start_ns=0))
    assert fan.num_errors == 1
