from __future__ import annotations

import pytest

from reference_server.serving.gateway_hooks import (
    GatewayHooks,
    GatewayObserver,
    RecordingGatewayObserver,
    Routed,
    Tokenized,
)


def test_emit_reaches_every_observer_in_order() -> None:
    a, b = RecordingGatewayObserver(), RecordingGatewayObserver()
    hooks = GatewayHooks((a,))
    hooks.add(b)
    event = Tokenized("r1", 10, 20, 3)
    hooks.emit("on_tokenized", event)
    hooks.emit("on_routed", Routed("r1", 20, 30, "colocated-0"))
    assert a.events == b.events == [event, Routed("r1", 20, 30, "colocated-0")]
    assert a.for_request("r1") == a.events and a.of_type(Routed) == [a.events[1]]


def test_observer_exceptions_are_counted_and_others_still_run() -> None:
    class Broken(GatewayObserver):
        def on_tokenized(self, event: Tokenized) -> None:
            raise RuntimeError("boom")

    after = RecordingGatewayObserver()
    hooks = GatewayHooks((Broken(), after))
    hooks.emit("on_tokenized", Tokenized("r", 1, 2, 1))
    assert hooks.num_observer_errors == 1
    assert len(after.events) == 1


def test_base_observer_methods_are_no_ops() -> None:
    hooks = GatewayHooks((GatewayObserver(),))
    hooks.emit("on_routed", Routed("r", 1, 2, "x"))
    assert hooks.num_observer_errors == 0


def test_remove() -> None:
    obs = RecordingGatewayObserver()
    hooks = GatewayHooks((obs,))
    hooks.remove(obs)
    assert hooks.observers == ()
    with pytest.raises(ValueError, match="not attached"):
        hooks.remove(obs)
