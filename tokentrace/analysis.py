"""A run opened for analysis: what ``tokentrace.open`` returns (application layer).

The store's :class:`tokentrace.store.Run` reads tables and knows nothing of the
analyzers (the core imports nothing above it). This subclass adds
:meth:`Run.analyze`, which hands the run to ``analyzers.analysis.RunAnalysis``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tokentrace.store import Run as StoreRun
from tokentrace.store import open_run as open_store_run

if TYPE_CHECKING:
    from analyzers.analysis import RunAnalysis

__all__ = ["Run", "open_run"]


class Run(StoreRun):
    """A store run with its analyses one call away."""

    def analyze(self) -> RunAnalysis:
        """The analyses of this run (``analyzers.analysis.RunAnalysis``).

        ``run.analyze().latency(by="tenant")``, ``.stage_breakdown()``, ``.goodput()``, ...;
        see ``docs/analyzers.md``. Each call builds a fresh one (it reads the files present now).
        """
        from analyzers.analysis import RunAnalysis

        return RunAnalysis(self)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"


def open_run(path: str | os.PathLike[str], run: str | None = None) -> Run:
    """Open run ``run`` (default: the newest) of the store at ``path``; see ``tokentrace.store.open_run``."""
    return Run(open_store_run(path, run).path)
