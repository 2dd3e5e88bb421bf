"""A run opened for analysis: what ``tokentrace.open`` returns (application layer).

The store's :class:`tokentrace.store.Run` reads tables and knows nothing of the
analyzers (the core imports nothing above it). This subclass adds
:meth:`Run.analyze`, which hands the run to ``analyzers.analysis.RunAnalysis``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from tokentrace.store import Run as StoreRun
from tokentrace.store import open_run as open_store_run

if TYPE_CHECKING:
    from analyzers.analysis import RunAnalysis

__all__ = ["Run", "open_run"]


class Run(StoreRun):
    """A store run with its analyses one call away.

    ``engine``: what :meth:`analyze` runs the analyses on unless told otherwise: ``"duckdb"`` (the
    default, embedded) or ``"spark"`` (``spark_master``: default ``local[*]``, or the active session's).
    """

    def __init__(self, path: str | os.PathLike[str], *, engine: str | None = None,
                 spark_master: str | None = None) -> None:
        super().__init__(path)
        self.engine = engine
        self.spark_master = spark_master

    def analyze(self, *, engine: Any = None) -> RunAnalysis:
        """The analyses of this run (``analyzers.analysis.RunAnalysis``).

        ``run.analyze().latency(by="tenant")``, ``.stage_breakdown()``, ``.goodput()``, ``.diagnosis()`` (why targets
        were missed), ...;
        see ``docs/analyzers.md``. Each call builds a fresh one (it reads the files present now).
        ``engine``: ``"duckdb"`` or ``"spark"`` (default: the one the run was opened with), or an
        ``analyzers.engine.Engine``.
        """
        from analyzers.analysis import RunAnalysis
        from analyzers.engine import open_engine

        chosen = engine if engine is not None else self.engine
        options = {"master": self.spark_master} if chosen == "spark" and self.spark_master else {}
        return RunAnalysis(self, engine=open_engine(chosen, **options))

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"


def open_run(path: str | os.PathLike[str], run: str | None = None, *, engine: str | None = None,
             spark_master: str | None = None) -> Run:
    """Open run ``run`` (default: the newest) of the store at ``path``; see ``tokentrace.store.open_run``.

    ``engine`` / ``spark_master``: the run's default for :meth:`Run.analyze`; ``ValueError`` for an unknown
    engine (checked here, before any analysis).
    """
    from analyzers.engine import ENGINES

    if engine is not None and engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")
    if spark_master is not None and engine != "spark":
        raise ValueError("spark_master is for engine='spark'")
    return Run(open_store_run(path, run).path, engine=engine, spark_master=spark_master)
