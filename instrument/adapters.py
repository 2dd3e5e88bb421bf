"""The bundled adapters, registered with the core through an entry point.

``pyproject.toml`` names :data:`ADAPTERS` in the ``tokentrace.adapters``
entry-point group; ``tokentrace.adapters.adapter_for`` loads it the first time
``tokentrace.instrument(target)`` is given a target. Three adapters:

* :class:`ReferenceEngineAdapter`: the reference ``Engine`` (or an
  ``AsyncEngine`` wrapping one), traced by
  :class:`instrument.reference_engine.EngineTracer`;
* :class:`ReferenceServingAdapter`: the reference serving stack's objects
  (gateway app or ``Gateway``, ``LocalBackend``, a worker process's
  ``Worker``), traced by the tracers :mod:`instrument.reference_serving` picks;
* :class:`instrument.hf_transformers.TransformersAdapter`: a Hugging Face transformers
  model, whose forward passes it times for ``instrument.hf_transformers.TokenStreamer``.

Neither imports the reference server for an object that is not its own.
Set-up code: runs once per ``instrument`` call, may raise ``TypeError``.
"""

from __future__ import annotations

from typing import Any

from instrument.hf_transformers import TransformersAdapter
from tokentrace.adapters import Attachment
from tokentrace.recorder import Recorder
from tokentrace.schema import Role

__all__ = ["ReferenceEngineAdapter", "ReferenceServingAdapter", "ADAPTERS"]


def _engine_of(target: Any) -> Any:
    """The reference ``Engine`` behind ``target``, or None if it is not one."""
    if not type(target).__module__.startswith("reference_server."):
        return None  # never import the reference server for someone else's object
    from reference_server.engine.async_engine import AsyncEngine
    from reference_server.engine.engine import Engine

    if isinstance(target, AsyncEngine):
        target = target.engine
    return target if isinstance(target, Engine) else None


class ReferenceEngineAdapter:
    """The reference engine, in-process: every stage, token, step and cache event."""

    targets = (
        "reference_server.engine.engine.Engine",
        "reference_server.engine.async_engine.AsyncEngine",
    )

    def matches(self, target: Any) -> bool:
        return _engine_of(target) is not None

    def default_role(self, target: Any) -> Role:
        return Role.COLOCATED

    def default_name(self, target: Any) -> str | None:
        return None

    def attach(self, target: Any, recorder: Recorder, role: Role) -> Attachment:
        from instrument.engine_config import record_engine_config
        from instrument.reference_engine import EngineTracer

        engine = _engine_of(target)
        if engine is None:
            raise TypeError(f"not a reference engine: {type(target).__name__}")
        record_engine_config(recorder, engine, role=role)
        tracer = EngineTracer(recorder)
        engine.add_observer(tracer)

        def detach() -> None:
            try:
                engine.remove_observer(tracer)
            except ValueError:  # already removed by the user
                pass

        return Attachment(tracer, detach)

    def __repr__(self) -> str:
        return "ReferenceEngineAdapter()"


class ReferenceServingAdapter:
    """The reference serving stack: gateway, in-process backend, worker processes."""

    def __init__(self) -> None:
        from instrument.reference_serving import TARGETS

        self.targets = TARGETS

    @staticmethod
    def _kind(target: Any) -> str | None:
        module = type(target).__module__
        if not module.startswith(("reference_server.", "starlette.")) and module != "__main__":
            return None  # never import the reference server for someone else's object
        from instrument.reference_serving import serving_kind

        return serving_kind(target)

    def matches(self, target: Any) -> bool:
        return self._kind(target) is not None

    def default_role(self, target: Any) -> Role:
        from instrument.reference_serving import default_role

        return default_role(target)

    def default_name(self, target: Any) -> str | None:
        name = getattr(target, "name", None) if self._kind(target) == "worker" else None
        return name if isinstance(name, str) and name else None

    def attach(self, target: Any, recorder: Recorder, role: Role) -> Attachment:
        from instrument.reference_serving import attach_serving

        tracers = attach_serving(target, recorder, role=role)
        return Attachment(tracers, tracers.detach)

    def __repr__(self) -> str:
        return "ReferenceServingAdapter()"


ADAPTERS = (ReferenceEngineAdapter(), ReferenceServingAdapter(), TransformersAdapter())
"""What the ``tokentrace.adapters`` entry point ``reference`` names."""
