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
    bind,
    cache_event,
    current,
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

    See ``tokentrace.store.open_run`` for how the run is chosen and the errors. ``engine``: what
    ``.analyze()`` runs on, ``"duckdb"`` (default, embedded) or ``"spark"`` (the ``[spark]`` extra;
    ``spark_master`` default ``local[*]``); see ``docs/scaling.md``.
    """
    from tokentrace.analysis import open_run

    return open_run(path, run, engine=engine, spark_master=spark_master)


def runs(path: str | os.PathLike[str]) -> list[Any]:
    """Every run of the store at ``path``, oldest first; see ``tokentrace.store.list_runs``."""
    from tokentrace.store import list_runs

    return list_runs(path)
