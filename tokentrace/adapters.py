"""The adapter registry: what ``tokentrace.instrument(target)`` can attach to.

The core never imports an adapter. Adapters live in packages above it (the
bundled ones in ``instrument/``) and announce themselves through the
``tokentrace.adapters`` entry-point group (``pyproject.toml``), or at run time
through :func:`register_adapter`. :func:`adapter_for` loads the entry points
the first time a target needs an adapter, so ``tokentrace.instrument()``
without a target (the manual API) imports nothing but the core.

An entry point names either one :class:`Adapter` or an iterable of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from tokentrace.recorder.protocol import Recorder
from tokentrace.schema import Role

__all__ = ["ENTRY_POINT_GROUP", "Adapter", "Attachment", "register_adapter", "adapters", "adapter_for"]

ENTRY_POINT_GROUP = "tokentrace.adapters"
"""The entry-point group adapters are registered under."""

log = logging.getLogger("tokentrace")


@dataclass(frozen=True, slots=True)
class Attachment:
    """What :meth:`Adapter.attach` returns: the tracer object(s) and how to detach them."""

    tracer: Any
    """Shown to the user as ``Handle.adapter`` (e.g. an ``EngineTracer``)."""
    detach: Callable[[], None]
    """Undo the attachment; called once by ``Handle.close``; must not raise."""


@runtime_checkable
class Adapter(Protocol):
    """Turns one kind of server object's activity into tokentrace events.

    ``matches`` is called for every target passed to ``tokentrace.instrument``:
    it must be cheap and must not import the server's modules for an object
    that is not the server's (check ``type(target).__module__`` first).
    Set-up code: ``attach`` may raise ``TypeError`` / ``ValueError``.
    """

    targets: tuple[str, ...]
    """What it attaches to, in words (listed when no adapter matches)."""

    def matches(self, target: Any) -> bool: ...

    def default_role(self, target: Any) -> Role:
        """The role the target's process plays when the caller did not say."""
        ...

    def default_name(self, target: Any) -> str | None:
        """The instance name the target suggests (a worker's name), or None."""
        ...

    def attach(self, target: Any, recorder: Recorder, role: Role) -> Attachment: ...


_lock = threading.Lock()
_registered: list[Adapter] = []
_entry_points_loaded = False


def register_adapter(adapter: Adapter) -> None:
    """Add ``adapter`` (tried before the entry-point adapters). ``TypeError`` if it is not one."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"not a tokentrace adapter: {adapter!r} (see tokentrace.adapters.Adapter)")
    with _lock:
        if adapter not in _registered:
            _registered.insert(0, adapter)


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        found: list[Adapter] = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = ep.load()
            except Exception as err:  # a broken third-party adapter must not break tracing
                log.warning("tokentrace: could not load adapter entry point %s (%s)", ep.value, err)
                continue
            items = loaded if isinstance(loaded, Iterable) else (loaded,)
            for item in items:
                if isinstance(item, Adapter):
                    found.append(item)
                else:
                    log.warning("tokentrace: entry point %s gave %r, not an adapter", ep.value, item)
        _registered.extend(a for a in found if a not in _registered)


def adapters() -> tuple[Adapter, ...]:
    """Every adapter known: registered ones first, then the entry points'."""
    _load_entry_points()
    with _lock:
        return tuple(_registered)


def adapter_for(target: Any) -> Adapter:
    """The first adapter that matches ``target``; ``TypeError`` naming what is supported."""
    known = adapters()
    for adapter in known:
        if adapter.matches(target):
            return adapter
    supported = ["None (manual API: tokentrace.span(), tokentrace.stage(), ...)"]
    supported += [t for a in known for t in a.targets]
    raise TypeError(
        f"tokentrace.instrument() has no adapter for {type(target).__name__} objects; "
        f"supported targets: {'; '.join(supported)}"
    )
