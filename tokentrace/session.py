"""``tokentrace.instrument``: set up a recorder, write its instance row, bind it.

This is the implementation of the facade's ``instrument`` (re-exported by
``tokentrace/__init__.py``), so like the facade it may reach outward, lazily,
inside functions: to the store writer (``tokentrace.store``) and to the
adapters of the ``instrument`` package. Importing this module imports
neither, so ``import tokentrace`` stays light for servers that record into a
custom sink.

Supported targets today: ``None`` (the manual API only), the reference
engine (``reference_server.engine.engine.Engine``, or an ``AsyncEngine``
wrapping one), traced by ``instrument.reference_engine.EngineTracer``, and
the reference serving stack's objects (gateway app, ``LocalBackend``, worker),
traced by the adapters ``instrument.reference_serving`` picks.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Callable, Mapping

from tokentrace import api
from tokentrace.recorder import Recorder
from tokentrace.schema import Role
from tokentrace.sink import Sink

__all__ = ["Handle", "instrument", "RECORDER_OPTIONS"]

RECORDER_OPTIONS = ("memory_cap_bytes", "flush_interval_s", "batch_rows")
"""Keyword options ``instrument`` passes on to the :class:`Recorder`."""


class Handle:
    """What :func:`instrument` returns: the live recorder; close it to stop tracing.

    A context manager. :meth:`close` unbinds the manual API (if this recorder
    is still the bound one), flushes and closes the sink; it is idempotent.
    """

    __slots__ = ("recorder", "adapter", "_detach")

    def __init__(self, recorder: Recorder, *, adapter: Any = None,
                 detach: Callable[[], None] | None = None) -> None:
        self.recorder = recorder
        self.adapter = adapter
        """The object translating the target's events (e.g. an EngineTracer), or None."""
        self._detach = detach

    @property
    def sink(self) -> Sink:
        return self.recorder.sink

    @property
    def instance_id(self) -> int:
        return self.recorder.instance_id

    @property
    def run_id(self) -> str | None:
        """The store run being written, or None for a plain sink."""
        return getattr(self.recorder.sink, "run_id", None)

    @property
    def counters(self) -> dict[str, int]:
        return self.recorder.counters

    def flush(self) -> None:
        """Write everything recorded so far (blocks on the sink)."""
        self.recorder.flush()

    def close(self) -> None:
        """Detach from the target, unbind the manual API, flush and close. Idempotent."""
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()
        if api.current() is self.recorder:
            api.unbind()
        self.recorder.close()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Handle(instance_id={self.instance_id}, run_id={self.run_id!r}, sink={self.sink!r})"


def _role(role: Role | str | int) -> Role:
    if isinstance(role, str):
        return Role.from_label(role)
    try:
        return Role(role)
    except ValueError:
        valid = ", ".join(r.label for r in Role)
        raise ValueError(f"unknown role {role!r}; valid roles: {valid}") from None


SUPPORTED_TARGETS = (
    "None (manual API: tokentrace.span(), tokentrace.stage(), ...)",
    "reference_server.engine.engine.Engine",
    "reference_server.engine.async_engine.AsyncEngine",
    "reference_server.serving.gateway.create_app(...) app, or its Gateway",
    "reference_server.serving.backend.LocalBackend",
    "reference_server.serving.worker.Worker",
)


def _reference_engine(target: Any) -> Any:
    """The reference ``Engine`` behind ``target``, or None if it is not one."""
    if not type(target).__module__.startswith("reference_server."):
        return None  # never import the reference server for someone else's object
    from reference_server.engine.async_engine import AsyncEngine
    from reference_server.engine.engine import Engine

    if isinstance(target, AsyncEngine):
        target = target.engine
    return target if isinstance(target, Engine) else None


def _serving_kind(target: Any) -> str | None:
    """The kind of reference serving object ``target`` is, or None."""
    module = type(target).__module__
    if not module.startswith(("reference_server.", "starlette.")) and module != "__main__":
        return None  # never import the reference server for someone else's object
    from instrument.reference_serving import serving_kind

    return serving_kind(target)


def _unsupported(target: Any) -> None:
    raise TypeError(
        f"tokentrace.instrument() has no adapter for {type(target).__name__} objects; "
        f"supported targets: {'; '.join(SUPPORTED_TARGETS)}"
    )


def _attach(target: Any, recorder: Recorder, role: Role) -> tuple[Any, Callable[[], None]]:
    """Attach the adapter for ``target``; (adapter, detach). ``TypeError`` if there is none."""
    engine = _reference_engine(target)
    if engine is None:
        if _serving_kind(target) is None:
            _unsupported(target)
        from instrument.reference_serving import attach_serving

        tracers = attach_serving(target, recorder, role=role)
        return tracers, tracers.detach
    from instrument.reference_engine import EngineTracer

    tracer = EngineTracer(recorder)
    engine.add_observer(tracer)

    def detach() -> None:
        try:
            engine.remove_observer(tracer)
        except ValueError:  # already removed by the user
            pass

    return tracer, detach


def instrument(
    target: Any = None,
    *,
    store: str | os.PathLike[str] | None = None,
    run: str | None = None,
    sink: Sink | None = None,
    role: Role | str | None = None,
    name: str | None = None,
    instance_id: int | None = None,
    trace_config: Mapping[str, Any] | None = None,
    **options: Any,
) -> Handle:
    """Start tracing this process and bind the manual API to it.

    Exactly one of ``store`` (a folder: events go to a new or existing run
    ``run`` of that Parquet store) or ``sink`` (any ``Sink``) must be given.
    ``target``: the server to trace (see ``SUPPORTED_TARGETS``); None records
    only what the manual API is given. ``role``: ``gateway``, ``prefill``,
    ``decode``, ``colocated``, ``client`` or ``other`` (default: what a serving
    target does, e.g. a worker's role, else ``colocated``); ``name`` defaults
    to a worker's name, else ``<role>-<pid>``. ``instance_id``: only with a plain sink (default: the
    sink's ``instance_id`` attribute if it has one, else a random 63-bit id); a
    store writer chooses its own. ``trace_config``: JSON-serializable facts
    about the run (workload, settings) for the store's manifest; only with
    ``store``. ``options``: any of ``RECORDER_OPTIONS``.

    Raises ``TypeError`` for an unsupported target or unknown option,
    ``ValueError`` for bad arguments; creating the store may raise ``OSError``.
    Nothing stays bound or attached when it raises.
    """
    if target is not None and _reference_engine(target) is None and _serving_kind(target) is None:
        _unsupported(target)
    unknown = sorted(set(options) - set(RECORDER_OPTIONS))
    if unknown:
        raise TypeError(f"unknown instrument() options {unknown}; valid: {', '.join(RECORDER_OPTIONS)}")
    serving = target is not None and _reference_engine(target) is None
    if role is None and serving:
        from instrument.reference_serving import default_role

        role = default_role(target)
    the_role = _role("colocated" if role is None else role)
    if name is None:
        worker_name = getattr(target, "name", None) if serving else None
        name = worker_name if isinstance(worker_name, str) else f"{the_role.label}-{os.getpid()}"
    sink, instance_id = _open_sink(store, run, sink, instance_id, trace_config,
                                   dict(options, role=the_role.label, name=name))
    recorder = Recorder(sink, instance_id=instance_id, **options)
    recorder.instance(role=the_role, name=name)
    adapter, detach = None, None
    if target is not None:
        try:
            adapter, detach = _attach(target, recorder, the_role)
        except BaseException:
            recorder.close()
            raise
    api.bind(recorder)
    return Handle(recorder, adapter=adapter, detach=detach)


def _open_sink(store: str | os.PathLike[str] | None, run: str | None, sink: Sink | None,
               instance_id: int | None, trace_config: Mapping[str, Any] | None,
               settings: dict[str, Any]) -> tuple[Sink, int]:
    """The sink to record into and the instance id for its rows; ``ValueError`` if misused."""
    if (store is None) == (sink is None):
        raise ValueError("instrument() needs exactly one of store=<folder> or sink=<Sink>")
    if store is None:
        if run is not None or trace_config is not None:
            raise ValueError("run= and trace_config= describe a run of a store; pass store= as well")
        if instance_id is None:
            try:
                instance_id = sink.instance_id  # e.g. a store writer passed as a plain sink
            except AttributeError:
                instance_id = secrets.randbits(63)
        return sink, instance_id
    if instance_id is not None:
        raise ValueError("instance_id cannot be chosen with store=: the store writer assigns it")
    from tokentrace.store import StoreWriter  # lazy: only needed with a store

    writer = StoreWriter(store, run_id=run, config={**(trace_config or {}), **settings})
    return writer, writer.instance_id
