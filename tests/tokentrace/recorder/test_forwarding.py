"""The forwarding base of recorder wrappers: every protocol member forwarded unchanged; wrappers override one."""

from __future__ import annotations

import inspect

import pytest

from instrument.clock_sync import SkewedRecorder
from instrument.sampling import SamplingRecorder
from tokentrace.live_metrics import MetricsRecorder
from tokentrace.recorder import ForwardingRecorder, Recorder
from tokentrace.recorder.untraced import UntracedRecorder

METHODS = sorted(name for name, member in vars(Recorder).items()
                 if not name.startswith("_") and inspect.isfunction(member))
PROPERTIES = sorted(name for name, member in vars(Recorder).items() if isinstance(member, property))


class Spy:
    """Answers every call with its name and arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return name

        return call


def _arguments(name: str) -> tuple[tuple, dict]:
    """Distinct values for every parameter of ``Recorder.<name>``, positional and keyword as the protocol has them."""
    args, kwargs = [], {}
    for i, p in enumerate(list(inspect.signature(getattr(Recorder, name)).parameters.values())[1:]):
        value = f"s{i}" if p.name == "key" or p.annotation in ("str", "str | None") else 100 + i
        if p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def test_the_base_implements_the_whole_protocol():
    assert METHODS and PROPERTIES
    for name in METHODS:
        assert inspect.signature(getattr(ForwardingRecorder, name)) == inspect.signature(getattr(Recorder, name)), name
    assert all(isinstance(vars(ForwardingRecorder)[name], property) for name in PROPERTIES)
    assert isinstance(ForwardingRecorder(Spy()), Recorder)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", METHODS)
def test_every_method_is_forwarded_with_its_arguments(name):
    spy = Spy()
    args, kwargs = _arguments(name)
    getattr(ForwardingRecorder(spy), name)(*args, **kwargs)  # type: ignore[arg-type]
    ((called, got_args, got_kwargs),) = spy.calls
    assert called == name
    bound = inspect.signature(getattr(Recorder, name)).bind(None, *got_args, **got_kwargs)
    assert dict(list(bound.arguments.items())[1:]) == {**dict(zip(
        list(inspect.signature(getattr(Recorder, name)).parameters)[1:], args)), **kwargs}


def test_wrappers_derive_from_the_base_and_the_skew_wrapper_changes_only_times():
    for wrapper in (SamplingRecorder, SkewedRecorder, MetricsRecorder):
        assert issubclass(wrapper, ForwardingRecorder)
    assert isinstance(UntracedRecorder("off"), Recorder)
    spy = Spy()
    skewed = SkewedRecorder(spy, 1_000)  # type: ignore[arg-type]
    skewed.span(7, 3, 10, 20, 2, 5, 9, 1, 4)
    skewed.loop_lag(1, 2)
    skewed.loop_lag(1, 2, 0, 5, 9)  # armed at 0: a time; the CPU durations stay
    skewed.step(1, 10, 20, 4, 0, 4, 0, 4, 0, 7)
    assert spy.calls[0] == ("span", (7, 3, 1_010, 1_020, 2, 5, 9, 1, 4), {})
    assert spy.calls[1] == ("loop_lag", (1_001, 1_002, -1, -1, -1), {})  # not measured stays -1
    assert spy.calls[2] == ("loop_lag", (1_001, 1_002, 1_000, 5, 9), {})
    assert spy.calls[3] == ("step", (1, 1_010, 1_020, 4, 0, 4, 0, 4, 0, 7), {})
