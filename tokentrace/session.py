"""``tokentrace.instrument``: set up a recorder, write its instance row, bind it.

Part of the core. What a ``target`` attaches to is decided by the adapter
registry (:mod:`tokentrace.adapters`): adapters live above the core (the
bundled ones in ``instrument/``, registered as entry points) and are found
without this module importing them. The store writer is imported only when
``store=`` is given, so ``import tokentrace`` stays light for servers that
record into a custom sink.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any, Callable, Mapping

from tokentrace import api
from tokentrace.adapters import adapter_for
from tokentrace.recorder import BufferedRecorder, Recorder
from tokentrace.recorder.sink import Sink
from tokentrace.recorder.untraced import UntracedRecorder
from tokentrace.schema import Role

log = logging.getLogger("tokentrace")

__all__ = ["Handle", "instrument", "RECORDER_OPTIONS"]

RECORDER_OPTIONS = ("memory_cap_bytes", "flush_interval_s", "batch_rows", "journal_interval_s")
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

    @property
    def untraced_reason(self) -> str | None:
        """Why nothing is traced (the store could not be opened), or None while tracing."""
        return self.recorder.reason if isinstance(self.recorder, UntracedRecorder) else None

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


def _with_metrics(recorder: Recorder, port: int, host: str) -> Recorder:
    """``recorder`` wrapped in a :class:`~tokentrace.live_metrics.MetricsRecorder` that serves ``/metrics``."""
    try:
        from tokentrace.live_metrics import MetricsRecorder, serve_metrics

        live = MetricsRecorder(recorder)
        serve_metrics(live, port=port, host=host)
    except BaseException:
        recorder.close()
        raise
    return live


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
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    **options: Any,
) -> Handle:
    """Start tracing this process and bind the manual API to it.

    Exactly one of ``store`` (a folder: events go to a new or existing run
    ``run`` of that Parquet store) or ``sink`` (any ``Sink``) must be given.
    ``target``: the server to trace (any object a registered adapter matches,
    see :mod:`tokentrace.adapters`; the bundled ones are listed in
    ``docs/instrumenting.md``); None records
    only what the manual API is given. ``role``: ``gateway``, ``prefill``,
    ``decode``, ``colocated``, ``client`` or ``other`` (default: what a serving
    target does, e.g. a worker's role, else ``colocated``); ``name`` defaults
    to a worker's name, else ``<role>-<pid>``. ``instance_id``: only with a plain sink (default: the
    sink's ``instance_id`` attribute if it has one, else a random 63-bit id); a
    store writer chooses its own. ``trace_config``: JSON-serializable facts
    about the run (workload, settings) for the store's manifest; only with
    ``store``. ``metrics_port``: serve live Prometheus metrics of this process on
    ``metrics_host:metrics_port`` (``/metrics``; 0 = any free port, a taken one moves to the
    next; :mod:`tokentrace.live_metrics`; needs ``prometheus-client``). ``options``: any of
    ``RECORDER_OPTIONS``.

    Raises ``TypeError`` for an unsupported target or unknown option and
    ``ValueError`` for bad arguments; nothing stays bound or attached when it raises.
    A store that cannot be opened (read-only, a path under a file, a full disk) does
    not raise: it is logged as one warning and the handle traces nothing (its
    ``untraced_reason`` says why; the target is left as it was), because tracing must
    never stop the server it wraps. Later failures to write (the disk fills up) are
    counted in ``counters["sink_errors"]`` and noted in the run's manifest.
    """
    adapter = None if target is None else adapter_for(target)
    unknown = sorted(set(options) - set(RECORDER_OPTIONS))
    if unknown:
        raise TypeError(f"unknown instrument() options {unknown}; valid: {', '.join(RECORDER_OPTIONS)}")
    if role is None and adapter is not None:
        role = adapter.default_role(target)
    the_role = _role("colocated" if role is None else role)
    if name is None:
        suggested = None if adapter is None else adapter.default_name(target)
        name = suggested if suggested else f"{the_role.label}-{os.getpid()}"
    try:
        sink, instance_id = _open_sink(store, run, sink, instance_id, trace_config,
                                       dict(options, role=the_role.label, name=name))
    except OSError as err:
        reason = f"cannot open the store at {store}: {err.strerror or err}"
        log.warning("tokentrace: %s; the program runs on without tracing", reason)
        return Handle(UntracedRecorder(reason))
    recorder: Recorder = BufferedRecorder(sink, instance_id=instance_id, **options)
    recorder.instance(role=the_role, name=name)
    if metrics_port is not None:
        recorder = _with_metrics(recorder, metrics_port, metrics_host)
    tracer, detach = None, None
    if adapter is not None:
        try:
            attachment = adapter.attach(target, recorder, the_role)
        except BaseException:
            recorder.close()
            raise
        tracer, detach = attachment.tracer, attachment.detach
    api.bind(recorder)
    return Handle(recorder, adapter=tracer, detach=detach)


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
