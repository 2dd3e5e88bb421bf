"""The registry of derived facts, and saving them next to the run (``<run>/_derived``).

:data:`FACTS` lists every derived fact (:class:`analyzers.facts.Fact`, each declared
beside the analysis that owns it). :func:`derive` is a loop over it: each fact's
rows, as the door :func:`analyzers.facts.relation` builds them from the run's
tables, are written as a derived table of the run (:mod:`tokentrace.store.derived`),
stamped with the run's fingerprint (:meth:`tokentrace.store.reader.Run.fingerprint`,
taken before any part is read), :func:`analyzers.facts.format_key` and the fact's
signature. Later analyses of the run
(any process: the dashboard, ``tokentrace report``, a notebook) read them through the
same door (looked up by :meth:`analyzers.source.Source.of_run`);
the answers are the same, only sooner.

Every instance's parts are read through :class:`~analyzers.source.Source`, on the
run's reference clock with each instance's own offset, so the facts of a
multi-process run are those of the whole run. Run it once the run is finished
(:meth:`~tokentrace.store.reader.Run.is_finished`): a part written afterwards makes
the facts stale (and unused) until derived again.
"""

from __future__ import annotations

from typing import Any

from analyzers import facts
from analyzers.attribution import TOKEN_COVERAGE
from analyzers.batch import DECODE_TOKEN_STEPS
from analyzers.compare_values import STAGE_MEDIANS
from analyzers.diff import RUN_BOOTSTRAP
from analyzers.latency import TOKEN_GROUPS
from analyzers.slo import REQUEST_REPORTED_TOKENS
from analyzers.source import Source
from analyzers.spec_rows import SPEC_DECODE_TOKENS, SPEC_STEP_ROWS
from analyzers.stage_breakdown import REQUEST_STAGE_NS, TOKEN_STAGE_NS
from analyzers.tenants import REQUEST_COMPUTE_NS
from analyzers.timing import REQUEST_FACTS, TOKEN_STEPS, TOKEN_TIMES
from tokentrace.store.derived import held_copy, read_derived, remove_derived, write_derived

__all__ = ["FACTS", "derive"]

FACTS: tuple[facts.Fact, ...] = (TOKEN_TIMES, TOKEN_STEPS, REQUEST_FACTS, TOKEN_STAGE_NS, TOKEN_COVERAGE,
                                 REQUEST_STAGE_NS, REQUEST_COMPUTE_NS, DECODE_TOKEN_STEPS, REQUEST_REPORTED_TOKENS,
                                 TOKEN_GROUPS, SPEC_STEP_ROWS, SPEC_DECODE_TOKENS, RUN_BOOTSTRAP, STAGE_MEDIANS)
"""Every derived fact, in the order :func:`derive` writes them (a fact's builder may open an earlier one)."""

_BATCH_ROWS = 1 << 20  # rows per record batch streamed into a derived file


def derive(run: Any, *, force: bool = False) -> list[str]:
    """Write the run's derived facts that are missing or stale; returns the names written (``[]``: all current).

    ``run``: a ``tokentrace.store.reader.Run`` (or ``tokentrace.app.analysis.Run``). ``force`` rewrites current
    ones too. ``OSError`` when the store is not writable (facts written before stay valid).
    """
    fingerprint = run.fingerprint()  # before any part is read: a part added meanwhile leaves them stale
    key = facts.format_key()
    current = {} if force else read_derived(run.path, fingerprint, key)
    missing = [fact for fact in FACTS
               if fact.name not in current or current[fact.name].extra != facts.saved_metadata(fact)]
    if not missing:
        return []
    if force:
        remove_derived(run.path)
    src = Source.of_run(run)
    held = []  # snapshots of the facts written, read by the builders after them: another process may rewrite them
    try:
        for fact in missing:  # in registry order: a fact's builder reads the facts before it from their files
            path = write_derived(run.path, fact.name, facts.stream_rows(src, fact, _BATCH_ROWS),
                                 fingerprint=fingerprint, format_key=key, extra=facts.saved_metadata(fact))
            copy = held_copy(path)
            if copy is not None:  # else (removed already) the door builds the fact again when a builder needs it
                held.append(copy)
                facts.read_from(src, fact, copy.path)
        return [fact.name for fact in missing]
    finally:
        src.close()
