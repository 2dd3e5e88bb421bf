"""Zero-code instrumentation, the way ``opentelemetry-instrument`` does it.

``tokentrace run --store DIR -- <command>`` puts three variables into the
command's environment and prepends ``instrument/sitecustomize`` (and the folder
holding the ``instrument`` and ``tokentrace`` packages) to ``PYTHONPATH``:

* :data:`ENV_STORE` - the store folder (required; its absence turns all of this off);
* :data:`ENV_RUN`   - the run id every process writes into;
* :data:`ENV_SAMPLE` - head-sampling rate in ``(0, 1]`` (default 1: every request).

Python imports ``sitecustomize`` at start-up in every process of the command,
including the worker processes a ``ClusterBackend`` spawns (they inherit the
environment), and it calls :func:`install`, which:

* wraps ``reference_server.serving.gateway.create_app`` when that module is
  first imported (a ``sys.meta_path`` finder that runs a hook after the module
  executes), so the app it returns is traced (:mod:`instrument.reference_serving`);
* adds :func:`install_worker` to ``REFERENCE_SERVER_WORKER_PLUGINS``, the worker
  process's own plugin hook, so each worker traces its engine and KV transfers
  under its name and role;
* wraps ``reference_server.engine.engine.Engine.__init__`` so a bare engine
  (a script driving ``Engine`` or ``AsyncEngine`` itself) is traced too; an
  engine that turns out to serve a gateway or worker is re-attached with the
  serving tracer before it sees a request.

One recorder and one ``StoreWriter`` per process (created on first need), all
writing the same run; the instance row's role and name come from what the
process turns out to be (gateway, ``prefill``/``decode``/``colocated`` worker
and its name). Failure policy: tokentrace never breaks the traced program. Any
error while setting up (a store that cannot be opened included) is logged once as
a warning and the program runs on untraced; errors while recording are counted by
the recorder and noted in the run's manifest. Each process journals its events
every :data:`JOURNAL_INTERVAL_S`, so when the whole deployment is SIGKILLed the next
reader of the store recovers all but the last fraction of a second.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable

from instrument.child_env import ENV_METRICS_PORT, ENV_RUN, ENV_SAMPLE, ENV_STORE

__all__ = ["install", "install_worker", "process_handle"]

log = logging.getLogger("tokentrace")

PLUGINS_ENV = "REFERENCE_SERVER_WORKER_PLUGINS"  # the reference worker's documented plugin hook
WORKER_PLUGIN = "instrument.autoinstrument:install_worker"

FLUSH_INTERVAL_S = 5.0
"""How often each traced process writes a Parquet part per table (as OpenTelemetry's batch span
processor's 5 s default): every part has a fixed cost (one file per table, the manifest
fragment), which at 1 s took ~4% of a 2-core server's throughput (benchmarks/overhead.py)."""

JOURNAL_INTERVAL_S = 0.25
"""How often each traced process appends its buffered events to its crash journal
(:mod:`tokentrace.store.journal`): the most a SIGKILLed process loses (plus the flush
thread's 50 ms poll). An append is one small write per table, far cheaper than a part."""

_GATEWAY_MODULE = "reference_server.serving.gateway"
_ENGINE_MODULE = "reference_server.engine.engine"


# ---------------------------------------------------------------- the process's recorder


class _Process:
    """This process's tracing state (one per process; all calls under ``_lock``)."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.recorder: Any = None  # the recorder tracers write to (skewed in clock tests)
        self.failed = False
        self.warned = False
        self.engine_tracers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> tracer
        self.serving: list[Any] = []  # attached ServingTracers, kept alive


_STATE = _Process()
_lock = threading.RLock()


def _warn(what: str, exc: BaseException) -> None:
    _STATE.failed = True
    if not _STATE.warned:
        _STATE.warned = True
        log.warning("tokentrace: %s failed (%s: %s); the program runs on without tracing", what,
                    type(exc).__name__, exc)


def process_handle(*, role: Any, name: str | None) -> Any:
    """This process's :class:`~tokentrace.session.Handle`, created on first call.

    Later calls with another role/name re-write the instance row (readers take
    the latest). Returns None once setting up failed (warned once). Set-up
    thread; may block on creating the store folder.
    """
    with _lock:
        if _STATE.failed:
            return None
        if _STATE.handle is None:
            from tokentrace.session import instrument

            sample = os.environ.get(ENV_SAMPLE)
            config = {"launcher": "tokentrace run", "sample": float(sample) if sample else 1.0}
            port = os.environ.get(ENV_METRICS_PORT)
            handle = instrument(None, store=os.environ[ENV_STORE], run=os.environ.get(ENV_RUN) or None,
                                role=role, name=name, trace_config=config, flush_interval_s=FLUSH_INTERVAL_S,
                                journal_interval_s=JOURNAL_INTERVAL_S, metrics_port=int(port) if port else None)
            if handle.untraced_reason is not None:  # instrument() said why, once: serve untraced
                _STATE.failed = _STATE.warned = True
                return None
            _STATE.handle = handle
            _STATE.recorder = _wrap_recorder(_STATE.handle.recorder, sample)
        elif name is not None:
            _STATE.recorder.instance(role=role, name=name)
        return _STATE.handle


def _wrap_recorder(recorder: Any, sample: str | None) -> Any:
    if sample and float(sample) < 1.0:
        from instrument.sampling import SamplingRecorder

        return SamplingRecorder(recorder, rate=float(sample))
    return recorder


def _set_skew(name: str) -> None:
    """Tests only: skew this process's recording clock (``instrument.clock_sync.SKEW_ENV``)."""
    from instrument.clock_sync import SkewedRecorder, skew_for

    skew = skew_for(name)
    if skew and not isinstance(_STATE.recorder, SkewedRecorder):
        _STATE.recorder = SkewedRecorder(_STATE.recorder, skew)


# ---------------------------------------------------------------- attaching


def _attach_serving(target: Any, *, role: Any, name: str | None) -> None:
    from instrument.reference_serving import attach_serving, default_role

    with _lock:
        the_role = role if role is not None else default_role(target)
        if process_handle(role=the_role, name=name) is None:
            return
        if name is not None:
            _set_skew(name)
        engine = getattr(target, "engine", None)
        if engine is None:
            gateway = getattr(getattr(target, "state", None), "gateway", None)
            engine = getattr(getattr(gateway, "backend", None), "engine", None)
        _detach_bare_engine(engine)
        if getattr(_STATE.recorder, "skew_ns", 0):  # re-stamp the instance row with the skewed anchor
            _STATE.recorder.instance(role=the_role, name=name or "")
        _STATE.serving.append(attach_serving(target, _STATE.recorder, role=the_role))


def _detach_bare_engine(engine: Any) -> None:
    tracer = _STATE.engine_tracers.pop(engine, None) if engine is not None else None
    if tracer is not None:
        try:
            engine.remove_observer(tracer)
        except ValueError:
            pass


def _on_engine_created(engine: Any) -> None:
    """A bare ``Engine`` was built: trace it (replaced if it turns out to serve a gateway/worker)."""
    from instrument.reference_engine import EngineTracer
    from tokentrace.schema import Role

    with _lock:
        if process_handle(role=Role.COLOCATED, name=None) is None:
            return
        tracer = EngineTracer(_STATE.recorder)
        engine.add_observer(tracer)
        _STATE.engine_tracers[engine] = tracer


def install_worker(worker: Any) -> None:
    """``REFERENCE_SERVER_WORKER_PLUGINS`` hook: trace this worker process (never raises)."""
    try:
        from tokentrace.schema import Role

        _attach_serving(worker, role=Role.from_label(worker.role), name=worker.name)
    except Exception as e:
        _warn("instrumenting the worker", e)


def _wrap_create_app(module: Any) -> None:
    original = module.create_app
    if getattr(original, "__tokentrace_wrapped__", False):
        return

    def create_app(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)
        try:
            _attach_serving(app, role=None, name=None)
        except Exception as e:
            _warn("instrumenting the gateway app", e)
        return app

    create_app.__tokentrace_wrapped__ = True  # type: ignore[attr-defined]
    create_app.__doc__ = original.__doc__
    create_app.__wrapped__ = original  # type: ignore[attr-defined]
    module.create_app = create_app


def _wrap_engine(module: Any) -> None:
    cls = module.Engine
    original = cls.__init__
    if getattr(original, "__tokentrace_wrapped__", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            _on_engine_created(self)
        except Exception as e:
            _warn("instrumenting the engine", e)

    __init__.__tokentrace_wrapped__ = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__


_POST_IMPORT: dict[str, Callable[[Any], None]] = {
    _GATEWAY_MODULE: _wrap_create_app,
    _ENGINE_MODULE: _wrap_engine,
}


class _PostImportLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs our hook on the fresh module."""

    def __init__(self, loader: Any, hook: Callable[[Any], None]) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            self._hook(module)
        except Exception as e:
            _warn(f"hooking {module.__name__}", e)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of the few modules we hook."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        hook = _POST_IMPORT.get(fullname)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PostImportLoader(spec.loader, hook)
        return spec


def install() -> None:
    """Called by ``sitecustomize`` when :data:`ENV_STORE` is set. Never raises."""
    try:
        if any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
            return
        sample = os.environ.get(ENV_SAMPLE)
        if sample and not 0.0 < float(sample) <= 1.0:
            raise ValueError(f"{ENV_SAMPLE} must be in (0, 1], got {sample!r}")
        for name, hook in _POST_IMPORT.items():  # already imported (rare): hook it now
            if name in sys.modules:
                hook(sys.modules[name])
        sys.meta_path.insert(0, _PostImportFinder())
        plugins = [p for p in os.environ.get(PLUGINS_ENV, "").split(",") if p.strip()]
        if WORKER_PLUGIN not in plugins:
            os.environ[PLUGINS_ENV] = ",".join([*plugins, WORKER_PLUGIN])
    except Exception as e:
        _warn("installing tokentrace", e)
