"""A run's derived facts read back from its ``_derived`` folder instead of derived again.

The per-token and per-request facts every analysis shares (:mod:`analyzers.timing`),
the per-token stage sums and coverage (:mod:`analyzers.stage_breakdown`,
:mod:`analyzers.attribution`) are what a cold analysis of a big run spends most of
its time on. :mod:`analyzers.derivation` writes them next to the run
(:mod:`tokentrace.store.derived`), stamped with the fingerprint of the part files
they came from; a :class:`~analyzers.source.Source` opened on the run looks them up
once (:func:`attach`) and each fact's builder then reads the file in place
(:func:`view`: DuckDB reads only the columns a query needs) instead of deriving it. A stale or missing file
changes nothing: the builders derive from the raw tables as before.

The facts, each named like the temporary table it stands for (:data:`DERIVED_FACTS`):

* ``token_times``, ``token_steps``, ``request_facts``: exactly the tables
  :func:`analyzers.timing.token_times`, :func:`~analyzers.timing.token_steps` and
  :func:`~analyzers.timing.request_table` build;
* ``token_stage_ns``: one row per delivered token: request_id, token_index,
  latency_ns, stage_ns, covered_ns (as :func:`analyzers.attribution.token_coverage`)
  and one ``stage_<id>_ns`` column per stage the run's spans have (each token's
  spans of that stage clipped to its interval and summed, as
  :func:`analyzers.stage_breakdown.token_spans`);
* ``request_stage_ns``: one row per request with server spans: request_id, then
  ``stage_<id>_role_<role>_ns`` per (stage, role of the recording instance) the run
  has, the request's spans of that stage from instances of that role summed whole
  (null when it has none; role ``none`` for an instance missing from ``instances``),
  and per stage its token-0 spans have, ``first_stage_<id>_ns`` (their time summed)
  and ``first_stage_<id>_start_ns`` (the first one's start). What the load, cache,
  critical-path and slowest-request analyses sum per request;
* ``request_compute_ns``: request_id, compute_ns: the request's share of the engine
  steps it was in, summed (:func:`analyzers.tenants.compute_rows_sql`);
* ``decode_token_steps``: every delivered token i >= 1 with the step that produced it
  (:func:`analyzers.batch.decode_token_steps_sql`);
* ``request_reported_tokens``: request_id, reported: the most output tokens a server
  row of the request reported (:func:`analyzers.slo.reported_tokens_sql`);
* ``token_groups``: every delivered token of a request with a first token, with its
  latency and its request's arrival, tenant, class and instance (what a grouped latency
  table groups its ITL samples by; :func:`analyzers.latency.token_groups_sql`);
* ``spec_step_rows``: every ``spec_steps`` row with its proposals, accepted prefix, token
  range, phase times, the tokens it emitted and its step time
  (:func:`analyzers.spec_rows.spec_step_rows_sql`);
* ``spec_decode_tokens``: every delivered decode token with its mode (speculative or plain),
  whether it carries its step, its batch size and step time, and whether its step had
  speculating requests (:func:`analyzers.spec_rows.decode_tokens_sql`); empty for a run that
  never speculated (nothing reads it then).
* ``run_bootstrap``: the run's side of a comparison of two runs, as baseline and as candidate: per
  metric and statistic its sample size, value and 1,000 resampled values
  (:func:`analyzers.diff.run_bootstrap` with its default parameters, kept in the file's metadata).

This module imports no analysis (so the source and every analysis may import it).
"""

from __future__ import annotations

from typing import Any

from tokentrace.schema import SCHEMA_VERSION, Stage
from tokentrace.store.derived import DerivedFile, parts_fingerprint, read_derived

__all__ = ["DERIVED_FACTS", "FORMAT_VERSION", "format_key", "attach", "derived_file", "view",
           "stage_column", "request_stage_column", "first_stage_columns", "request_stage_layout",
           "STAGE_COLUMN_PREFIX", "ONE_ROW_PER_TOKEN"]

DERIVED_FACTS: tuple[str, ...] = ("token_times", "token_steps", "request_facts", "token_stage_ns",
                                  "request_stage_ns", "request_compute_ns", "decode_token_steps",
                                  "request_reported_tokens", "token_groups", "spec_step_rows",
                                  "spec_decode_tokens", "run_bootstrap")
"""The facts :mod:`analyzers.derivation` writes, in the order it derives them."""

FORMAT_VERSION = 1
"""Bump when what a fact holds changes: files of another version are stale."""

ONE_ROW_PER_TOKEN = "one_row_per_token"
"""Extra metadata of ``token_times``: ``"1"`` when one server process recorded each token once."""

STAGE_COLUMN_PREFIX = "stage_"
_FILES_KEY = "derived_files"  # Source cache key: name -> DerivedFile of the run's current facts


def format_key() -> str:
    """What this code derives: the facts' version, the schema version and every stage id it knows."""
    return f"{FORMAT_VERSION}/{SCHEMA_VERSION}/" + ",".join(str(int(s)) for s in Stage)


def stage_column(stage: int) -> str:
    """The ``token_stage_ns`` column of a stage id: ``stage_<id>_ns``."""
    return f"{STAGE_COLUMN_PREFIX}{int(stage)}_ns"


def request_stage_column(stage: int, role: int | None) -> str:
    """The ``request_stage_ns`` column of the spans of ``stage`` recorded by instances of ``role``."""
    return f"{STAGE_COLUMN_PREFIX}{int(stage)}_role_{'none' if role is None else int(role)}_ns"


def first_stage_columns(stage: int) -> tuple[str, str]:
    """The ``request_stage_ns`` columns of a stage's token-0 spans: (summed time, first start)."""
    return f"first_{STAGE_COLUMN_PREFIX}{int(stage)}_ns", f"first_{STAGE_COLUMN_PREFIX}{int(stage)}_start_ns"


def request_stage_layout(src: Any, relation: str) -> tuple[list[tuple[int, int | None, str]], list[int]]:
    """The columns of a ``request_stage_ns`` relation: [(stage, role or None, column)] and the stages with
    token-0 columns."""
    combos, first = [], []
    for name in src.engine.columns(relation):
        parts = name.split("_")
        if len(parts) == 5 and parts[0] == "stage" and parts[2] == "role" and parts[4] == "ns" and parts[1].isdigit():
            combos.append((int(parts[1]), None if parts[3] == "none" else int(parts[3]), name))
        elif len(parts) == 4 and parts[:2] == ["first", "stage"] and parts[3] == "ns" and parts[2].isdigit():
            first.append(int(parts[2]))
    return combos, first


def attach(src: Any, run: Any) -> None:
    """Look up the run's current derived facts once, for the builders of ``src`` (a Source on ``run``).

    Never raises for a missing, stale or unreadable folder: the source then derives everything itself.
    """
    path = getattr(run, "path", None)
    files: dict[str, DerivedFile] = {}
    if path is not None:
        try:
            files = read_derived(path, parts_fingerprint(path), format_key())
        except OSError:
            files = {}
    src.cached(_FILES_KEY, lambda: files)


def derived_file(src: Any, name: str) -> DerivedFile | None:
    """The current derived file of fact ``name`` for this source, or ``None`` (none, stale, in-memory source)."""
    return src.cached(_FILES_KEY, dict).get(name)


def view(src: Any, name: str) -> str | None:
    """Name of a view over the derived file of ``name`` (``derived_<name>``), or ``None`` without one."""
    found = derived_file(src, name)
    if found is None:
        return None

    def build() -> str:
        src.engine.parquet_view(f"derived_{name}", [([found.path.as_posix()], {})])
        return f"derived_{name}"
    return src.cached(f"derived_view_{name}", build)
