"""The environment a traced process hands to the processes it starts.

``tokentrace run`` starts its command with :func:`child_environment`: the store
and run to trace into, and ``PYTHONPATH`` led by the folder whose
``sitecustomize`` turns tracing on (:mod:`instrument.autoinstrument`). A
gateway instrumented in-process with a store does the same for the workers it
spawns (:func:`propagate_to_children`). Set-up code; never on a hot path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["ENV_STORE", "ENV_RUN", "ENV_SAMPLE", "ENV_METRICS_PORT", "SITE_DIR", "CODE_ROOT", "child_environment",
           "propagate_to_children"]

ENV_STORE = "TOKENTRACE_STORE"
ENV_RUN = "TOKENTRACE_RUN"
ENV_SAMPLE = "TOKENTRACE_SAMPLE"
ENV_METRICS_PORT = "TOKENTRACE_METRICS_PORT"
"""First port of the traced processes' live ``/metrics`` (each takes the next free one)."""
SITE_DIR = Path(__file__).resolve().parent / "sitecustomize"
"""The folder ``tokentrace run`` prepends to ``PYTHONPATH``."""
CODE_ROOT = SITE_DIR.parents[1]
"""The folder holding the ``instrument`` and ``tokentrace`` packages."""


def child_environment(store: str | os.PathLike[str], run: str, sample: float | None = None,
                      base: dict[str, str] | None = None, metrics_port: int | None = None) -> dict[str, str]:
    """The environment a traced command runs with: ``base`` (default ``os.environ``) plus ours."""
    env = dict(os.environ if base is None else base)
    env[ENV_STORE] = str(Path(store).resolve())
    env[ENV_RUN] = run
    if sample is not None:
        env[ENV_SAMPLE] = repr(float(sample))
    if metrics_port is not None:
        env[ENV_METRICS_PORT] = str(int(metrics_port))
    parts = [str(SITE_DIR), str(CODE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    seen: list[str] = []
    for p in parts:
        if p not in seen:
            seen.append(p)
    env["PYTHONPATH"] = os.pathsep.join(seen)
    return env


def propagate_to_children(sink: Any) -> None:
    """Let processes this one spawns trace into the same run (``instrument(app)`` with a store)."""
    store, run = getattr(sink, "store_path", None), getattr(sink, "run_id", None)
    if store is None or run is None or os.environ.get(ENV_STORE):
        return  # not a store, or this process is itself under `tokentrace run` (already set)
    os.environ.update(child_environment(store, run, base={"PYTHONPATH": os.environ.get("PYTHONPATH", "")}))
