"""tokentrace: token-level latency profiling for LLM inference serving.

The public facade. Record::

    handle = tokentrace.instrument(store="traces/", role="colocated")
    rid = tokentrace.request_begin("req-1", tenant="acme")
    with tokentrace.stage(rid, tokentrace.Stage.PREFILL_COMPUTE):
        ...
    tokentrace.request_end(rid)
    handle.close()

Read::

    run = tokentrace.open("traces/")        # newest run
    tokentrace.runs("traces/")              # every run

The facade sits in the application layer (``docs/architecture.md``): its
eager imports are core modules only, so ``import tokentrace`` stays light for a
server; the store reader and the analyzers are imported inside :func:`open`
and :func:`runs`.
"""

from __future__ import annotations

import os
from typing import Any

from tokentrace.api import (
    RequestContext,
    bind,
    cache_event,
    current,
    current_request,
    request_begin,
    request_end,
    span,
    stage,
    step,
    token_emitted,
    token_sent,
    unbind,
)
from tokentrace.clock import now_ns
from tokentrace.recorder import BufferedRecorder, InMemorySink, Recorder, Sink
from tokentrace.schema import CacheEventKind, RequestStatus, Role, Stage, Tier
from tokentrace.session import Handle, instrument
from tokentrace.version import __version__

__all__ = [
    "__version__",
    "Stage",
    "Role",
    "Tier",
    "CacheEventKind",
    "RequestStatus",
    "Recorder",
    "BufferedRecorder",
    "Sink",
    "InMemorySink",
    "Handle",
    "instrument",
    "open",
    "current_request",
    "RequestContext",
    "runs",
    "now_ns",
    "bind",
    "unbind",
    "current",
    "request_begin",
    "request_end",
    "span",
    "stage",
    "step",
    "token_emitted",
    "token_sent",
    "cache_event",
]


def open(path: str | os.PathLike[str], run: str | None = None, *, engine: str | None = None,  # noqa: A001
         spark_master: str | None = None) -> Any:
    """Open run ``run`` (default: the newest) of the store at ``path``, with ``.analyze()``.

    See ``tokentrace.store.open_run`` for how the run is chosen and the errors. When ``run`` is not
    given and the store holds several runs, a ``UserWarning`` names the one opened and the others
    (pass ``run=`` to choose). ``engine``: what ``.analyze()`` runs on, ``"duckdb"`` (default,
    embedded) or ``"spark"`` (the ``[spark]`` extra; ``spark_master`` default ``local[*]``); see
    ``docs/scaling.md``.
    """
    from tokentrace.app.analysis import open_run

    opened = open_run(path, run, engine=engine, spark_master=spark_master)
    if run is None:
        _say_which_run(path, opened.run_id)
    return opened


def _say_which_run(path: str | os.PathLike[str], opened: str) -> None:
    """Warn, naming the run opened, when the store at ``path`` holds several."""
    import warnings

    from tokentrace.store.reader import find_run_dirs

    others = [d.name for d in reversed(find_run_dirs(path)) if d.name != opened]
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        warnings.warn(f"{os.fspath(path)} holds {len(others) + 1} runs; opened the newest, {opened!r} "
                      f"(others: {shown}); pass run=... to choose one", UserWarning, stacklevel=3)


def runs(path: str | os.PathLike[str]) -> list[Any]:
    """Every run of the store at ``path``, oldest first; see ``tokentrace.store.list_runs``."""
    from tokentrace.store import list_runs

    return list_runs(path)
