"""Which tracers a reference serving object needs, and attaching them.

``tokentrace.instrument(target)`` dispatches here for the serving stack's objects
(the engine alone is handled by :mod:`instrument.reference_engine`):

=====================================  =============================================
target                                 tracers attached
=====================================  =============================================
gateway app (``create_app(...)``) or   :class:`GatewayTracer`; with a ``LocalBackend``
its ``Gateway``                        also a :class:`ServingEngineTracer` on its
                                       engine, sharing emit times (same clock); with
                                       a ``ClusterBackend`` a :class:`ClockServer`
                                       the workers align to
``LocalBackend``                       :class:`ServingEngineTracer` on its engine
``Worker`` (a worker process's)        :class:`WorkerTracer` and, when the gateway's
                                       clock address is in the environment, a
                                       :class:`ClockSync`
=====================================  =============================================

Worker processes of a ``ClusterBackend`` are traced from inside themselves,
by ``tokentrace run`` (:mod:`instrument.autoinstrument`); when the gateway app
is instrumented in-process with a store, the store and run are put into the
environment its workers inherit, so they are traced into the same run.
Set-up code: runs once, may raise ``TypeError``/``ValueError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Callable

from tokentrace.schema import Role

__all__ = ["ServingTracers", "serving_kind", "attach_serving", "TARGETS"]

TARGETS = (
    "reference_server.serving.gateway.create_app(...) app, or its Gateway",
    "reference_server.serving.backend.LocalBackend",
    "reference_server.serving.worker.Worker",
)


@dataclass(slots=True)
class ServingTracers:
    """What :func:`attach_serving` attached (the Handle's ``adapter``)."""

    gateway: Any = None
    engine: Any = None
    worker: Any = None
    clock_server: Any = None
    clock_sync: Any = None
    saved_env: dict[str, str | None] = field(default_factory=dict)
    detachers: list[Callable[[], None]] = field(default_factory=list)

    def detach(self) -> None:
        for undo in reversed(self.detachers):
            try:
                undo()
            except ValueError:  # already removed by the user
                pass
        self.detachers.clear()
        if self.clock_server is not None:
            self.clock_server.close()
        if self.clock_sync is not None:
            self.clock_sync.close()
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.saved_env.clear()


def serving_kind(target: Any) -> str | None:
    """``"gateway"``, ``"local_backend"``, ``"worker"`` or None (not a serving object)."""
    module = type(target).__module__
    if _is_worker(target):
        return "worker"
    if not module.startswith(("reference_server.", "starlette.")):
        return None
    if _gateway_of(target) is not None:
        return "gateway"
    from reference_server.serving.backend import LocalBackend

    return "local_backend" if isinstance(target, LocalBackend) else None


def _is_worker(target: Any) -> bool:
    """A ``reference_server.serving.worker.Worker``, also when that module runs as ``__main__``."""
    module = type(target).__module__
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = getattr(spec, "name", module)
    if module != "reference_server.serving.worker" or type(target).__name__ != "Worker":
        return False
    return hasattr(target, "engine") and hasattr(target, "add_observer")


def _gateway_of(target: Any) -> Any:
    from reference_server.serving.gateway import Gateway

    if isinstance(target, Gateway):
        return target
    state = getattr(target, "state", None)
    gateway = getattr(state, "gateway", None) if state is not None else None
    return gateway if isinstance(gateway, Gateway) else None


def default_role(target: Any) -> Role:
    """The role an instrumented serving object's process plays."""
    kind = serving_kind(target)
    if kind == "worker":
        return Role.from_label(target.role)
    if kind == "gateway":
        from reference_server.serving.backend import LocalBackend

        return Role.COLOCATED if isinstance(_gateway_of(target).backend, LocalBackend) else Role.GATEWAY
    return Role.COLOCATED


def attach_serving(target: Any, recorder: Any, *, role: Role) -> ServingTracers:
    """Attach the tracers ``target`` needs (see the module table); ``TypeError`` if none fit."""
    kind = serving_kind(target)
    out = ServingTracers()
    if kind == "gateway":
        _attach_gateway(_gateway_of(target), recorder, out)
        if target is not _gateway_of(target):  # the app itself: flush when it shuts down
            flush_on_shutdown(target, recorder, out)
    elif kind == "local_backend":
        _attach_engine(target.engine, recorder, out, relay=None)
    elif kind == "worker":
        _attach_worker(target, recorder, out, role)
    else:
        raise TypeError(f"not a reference serving object: {type(target).__name__}")
    return out


def _attach_engine(engine: Any, recorder: Any, out: ServingTracers, *, relay: Any) -> None:
    from instrument.engine_config import record_engine_config
    from instrument.reference_cluster import ServingEngineTracer

    record_engine_config(recorder, engine, role=Role.COLOCATED)  # an in-process engine does both
    out.engine = ServingEngineTracer(recorder, relay=relay)
    engine.add_observer(out.engine)
    out.detachers.append(lambda: engine.remove_observer(out.engine))


def flush_on_shutdown(app: Any, recorder: Any, out: ServingTracers) -> None:
    """Flush ``recorder`` when ``app``'s lifespan ends (its server shuts down).

    uvicorn re-raises SIGTERM/SIGINT after a graceful shutdown, so the process may
    die of the signal without running ``atexit`` hooks: the rows buffered since
    the last periodic flush would be lost. Restored on detach.
    """
    router = getattr(app, "router", None)
    original = getattr(router, "lifespan_context", None)
    if original is None:
        return

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        try:
            async with original(a) as state:
                yield state
        finally:
            await asyncio.to_thread(recorder.flush)

    router.lifespan_context = lifespan
    out.detachers.append(lambda: setattr(router, "lifespan_context", original))


def _attach_gateway(gateway: Any, recorder: Any, out: ServingTracers) -> None:
    from instrument import transport
    from instrument.reference_cluster import TokenRelay
    from instrument.reference_gateway import GatewayTracer
    from reference_server.serving.backend import LocalBackend

    relay = None
    if isinstance(gateway.backend, LocalBackend):
        relay = TokenRelay()
        _attach_engine(gateway.backend.engine, recorder, out, relay=relay)
    else:
        _serve_clock(recorder, out)
    transport.install()  # first-byte times for gateway.accept (the gateway serves on uvicorn)
    clocks = None if out.clock_server is None else out.clock_server.book
    out.gateway = GatewayTracer(recorder, relay=relay, clocks=clocks)
    gateway.add_observer(out.gateway)
    out.detachers.append(lambda: gateway.remove_observer(out.gateway))
    out.detachers.append(out.gateway.close)
    if relay is None:  # events the backend relays from its workers (KV transfer starts)
        gateway.backend.add_observer(out.gateway)
        out.detachers.append(lambda: gateway.backend.remove_observer(out.gateway))


def _serve_clock(recorder: Any, out: ServingTracers) -> None:
    """Serve this (reference) process's clock to the workers it will spawn."""
    from instrument.child_env import ENV_RUN, ENV_STORE, propagate_to_children
    from instrument.clock_sync import CLOCK_ADDR_ENV, ClockServer

    out.clock_server = ClockServer(clock=recorder.clock)
    keys = (CLOCK_ADDR_ENV, ENV_STORE, ENV_RUN, "PYTHONPATH")
    out.saved_env = {k: os.environ.get(k) for k in keys}
    os.environ[CLOCK_ADDR_ENV] = out.clock_server.address
    propagate_to_children(recorder.sink)


def _attach_worker(worker: Any, recorder: Any, out: ServingTracers, role: Role) -> None:
    from instrument.clock_sync import CLOCK_ADDR_ENV, ClockSync, SkewedRecorder
    from instrument.reference_cluster import WorkerTracer

    out.worker = WorkerTracer(recorder, worker)
    out.worker.attach()
    out.engine = out.worker.engine_tracer
    out.detachers.append(out.worker.detach)
    address = os.environ.get(CLOCK_ADDR_ENV)
    if address:
        skew_ns = recorder.skew_ns if isinstance(recorder, SkewedRecorder) else 0
        out.clock_sync = ClockSync(recorder, address, role=role, name=worker.name, clock=recorder.clock,
                                   clock_skew_ns=skew_ns)
        out.clock_sync.start()
