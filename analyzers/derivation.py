"""Derive a run's shared facts once and keep them next to the run (``<run>/_derived``).

:func:`derive` computes, through the same queries an analysis runs, the facts listed
in :data:`analyzers.facts.DERIVED_FACTS` and writes each as a derived table of the run
(:mod:`tokentrace.store.derived`), stamped with the fingerprint of the part files it
read. Later analyses of the run (any process: the dashboard, ``tokentrace report``,
a notebook) read them instead of deriving them (:mod:`analyzers.facts`); the answers
are the same, only sooner.

Every instance's parts are read through :class:`~analyzers.source.Source`, on the
run's reference clock with each instance's own offset, so the facts of a
multi-process run are those of the whole run. Run it once the run is finished: a
part written afterwards makes the facts stale (and unused) until derived again.
"""

from __future__ import annotations

from typing import Any

from analyzers import facts
from analyzers.attribution import token_coverage
from analyzers.batch import decode_token_steps_sql
from analyzers.diff import bootstrap_fact
from analyzers.latency import token_groups_sql
from analyzers.slo import reported_tokens_sql
from analyzers.source import Source
from analyzers.spec_rows import decode_tokens_sql, has_speculation, spec_step_rows_sql
from analyzers.stage_breakdown import token_stage_sql
from analyzers.tenants import compute_rows_sql
from analyzers.timing import LATENCY, request_table, token_steps, token_times
from tokentrace.schema import col
from tokentrace.store.derived import parts_fingerprint, read_derived, remove_derived, write_derived

__all__ = ["derive", "run_is_finished"]

_BATCH_ROWS = 1 << 20  # rows per record batch streamed into a derived file


def run_is_finished(run: Any) -> bool:
    """True when every process that wrote the run closed its writer (no part will follow)."""
    from tokentrace.store.manifest import read_fragments

    fragments = read_fragments(run.path)
    return bool(fragments) and all(f.get("closed") is True for f in fragments)


def derive(run: Any, *, force: bool = False) -> list[str]:
    """Write the run's derived facts that are missing or stale; returns the names written (``[]``: all current).

    ``run``: a ``tokentrace.store.reader.Run`` (or ``tokentrace.analysis.Run``). ``force`` rewrites current
    ones too. ``OSError`` when the store is not writable (facts written before stay valid).
    """
    fingerprint = parts_fingerprint(run.path)  # before any part is read: a part added meanwhile leaves them stale
    key = facts.format_key()
    current = {} if force else read_derived(run.path, fingerprint, key)
    missing = [name for name in facts.DERIVED_FACTS if name not in current]
    if not missing:
        return []
    if force:
        remove_derived(run.path)
    src = Source.of_run(run)
    try:
        written = []
        for name in missing:
            data, extra = _fact(src, name)
            write_derived(run.path, name, data, fingerprint=fingerprint, format_key=key, extra=extra)
            written.append(name)
        return written
    finally:
        src.close()


def _fact(src: Source, name: str) -> tuple[Any, dict[str, str]]:
    """The rows of fact ``name`` (a record batch stream) and the extra metadata to write with them."""
    if name == "token_times":
        times = token_times(src)
        one_row = "1" if src.cached(facts.ONE_ROW_PER_TOKEN, lambda: False) else "0"
        return _rows(src, f"SELECT * FROM {times}"), {facts.ONE_ROW_PER_TOKEN: one_row}
    if name == "token_steps":
        return _rows(src, f"SELECT * FROM {token_steps(src)}"), {}
    if name == "request_facts":
        return _rows(src, f"SELECT * FROM {request_table(src)}"), {}
    if name == "token_stage_ns":
        return _rows(src, _token_stage_ns_sql(src)), {}
    if name == "request_stage_ns":
        return _rows(src, _request_stage_ns_sql(src)), {}
    if name == "request_compute_ns":
        return _rows(src, f"SELECT {col.REQUEST_ID}, SUM(compute_ns) AS compute_ns FROM ({compute_rows_sql(src)}) "
                          f"GROUP BY {col.REQUEST_ID}"), {}
    if name == "decode_token_steps":
        return _rows(src, decode_token_steps_sql(src)), {}
    if name == "request_reported_tokens":
        return _rows(src, reported_tokens_sql()), {}
    if name == "token_groups":
        return _rows(src, token_groups_sql(src)), {}
    if name == "run_bootstrap":
        return bootstrap_fact(src)
    if name == "spec_step_rows":
        return _rows(src, spec_step_rows_sql(src)), {}
    if name == "spec_decode_tokens":  # read only when the run speculated: otherwise its columns alone
        return _rows(src, decode_tokens_sql(src) + ("" if has_speculation(src) else " LIMIT 0")), {}
    raise ValueError(f"unknown derived fact {name!r}; facts: {', '.join(facts.DERIVED_FACTS)}")


def _token_stage_ns_sql(src: Source) -> str:
    """One row per delivered token: latency, stage and covered time (as ``token_coverage``), and one column of
    in-interval time per stage the run's spans have (as :func:`analyzers.stage_breakdown.token_stage_sql`)."""
    c = col
    stages = [int(row[0]) for row in src.df(f"SELECT DISTINCT {c.STAGE} FROM srv_spans "
                                            f"WHERE {c.STAGE} IS NOT NULL ORDER BY 1").itertuples(index=False)]
    cov = token_coverage(src)
    per_stage = ", ".join(f"CAST(COALESCE(w.{facts.stage_column(st)}, 0) AS BIGINT) AS {facts.stage_column(st)}"
                          for st in stages)
    return f"""
        SELECT v.{c.REQUEST_ID}, v.{c.TOKEN_INDEX}, v.{LATENCY}, CAST(v.stage_ns AS BIGINT) AS stage_ns,
               CAST(v.covered_ns AS BIGINT) AS covered_ns{", " + per_stage if per_stage else ""}
        FROM {cov} v LEFT JOIN ({token_stage_sql(src, stages)}) w USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
    """


def _request_stage_ns_sql(src: Source) -> str:
    """One row per request with server spans: its spans' whole time per (stage, recording role), and per stage
    of its token-0 spans their time and first start (:data:`analyzers.facts.DERIVED_FACTS`)."""
    c = col
    combos = src.df(f"""
        SELECT s.{c.STAGE} AS stage, i.{c.ROLE} AS role,
               MAX(CASE WHEN s.{c.TOKEN_INDEX} = 0 THEN 1 ELSE 0 END) AS has_first
        FROM srv_spans s LEFT JOIN instances i USING ({c.INSTANCE_ID}) WHERE s.{c.STAGE} IS NOT NULL
        GROUP BY s.{c.STAGE}, i.{c.ROLE}
    """)
    dur = f"s.{c.END_NS} - s.{c.START_NS}"
    parts = []
    for stage, role in sorted({(int(st), None if r is None or r != r else int(r))
                               for st, r in zip(combos["stage"], combos["role"])}, key=lambda x: (x[0], -1 if x[1] is None else x[1])):
        role_is = f"i.{c.ROLE} IS NULL" if role is None else f"i.{c.ROLE} = {role}"
        parts.append(f"CAST(SUM(CASE WHEN s.{c.STAGE} = {stage} AND {role_is} THEN {dur} END) AS BIGINT) "
                     f"AS {facts.request_stage_column(stage, role)}")
    for stage in sorted({int(st) for st, f in zip(combos["stage"], combos["has_first"]) if f == 1}):
        ns, start = facts.first_stage_columns(stage)
        first = f"s.{c.STAGE} = {stage} AND s.{c.TOKEN_INDEX} = 0"
        parts.append(f"CAST(SUM(CASE WHEN {first} THEN {dur} END) AS BIGINT) AS {ns}")
        parts.append(f"MIN(CASE WHEN {first} THEN s.{c.START_NS} END) AS {start}")
    return f"""
        SELECT s.{c.REQUEST_ID}{"".join(", " + p for p in parts)}
        FROM srv_spans s LEFT JOIN instances i USING ({c.INSTANCE_ID})
        GROUP BY s.{c.REQUEST_ID}
    """


def _rows(src: Source, sql: str) -> Any:
    """The result of ``sql`` as a stream of record batches (DuckDB) or an Arrow table (other engines)."""
    con = getattr(src.engine, "con", None)
    if con is not None:
        con.execute("SELECT 1").fetchall()  # finishes a result a previous fetchone left open, which blocks streaming
        return con.sql(sql).to_arrow_reader(_BATCH_ROWS)
    return src.arrow(sql)
