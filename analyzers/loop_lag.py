"""Event-loop lag: how late a serving process's loop ran, and how much stage time it explains.

A tracer on an asyncio loop (the gateway's) records ticks that ran late as
``loop_lags`` intervals ``[due, ran)`` (``instrument.loop_lag``): while one is open,
everything waiting on that loop waits. Two tables:

* per sampled instance: late ticks, their total and longest length (ms), and their
  share of the instance's window (first to last recorded time);
* per stage recorded by a sampled instance: its total time over all spans (ms), the
  part inside a late interval of the same instance (ms), and that share. A large share
  for ``gateway.accept`` or ``stream.relay`` says a busy loop, not the network or the
  engine, is where that time went.

Intervals of one loop never overlap (a tick is scheduled when the previous one ran).

Why the loop ran late (:func:`late_intervals_sql`, the one rule every reader uses). A row's tick
knows the CPU time its loop's thread (``loop_cpu_ns``) and its whole process (``process_cpu_ns``)
used from when it was armed until it ran, a window ``w = end_ns - armed_ns`` that holds the late
interval ``[start_ns, end_ns)`` and at most one sampling period before it. Taking that CPU as
spread evenly over the window, each late interval splits into three shares:

* ``blocking`` = loop CPU / w: the loop's own thread was running (a long callback);
* ``other_threads`` = (process CPU - loop CPU) / w, at most what is left: another thread of the
  process was running, holding the GIL the loop waits for (an engine thread in the same process);
* ``starved`` = the rest: neither ran (other processes had the host's CPUs, or the loop's thread
  waited off the CPU: a ``time.sleep``, synchronous I/O, a lock).

Each share is clipped to [0, 1] (a process's threads can use more than one CPU). Per instance, the
late time is summed per share; the instance's ``cause`` is the share holding at least
``MAIN_CAUSE_SHARE`` of its measured late time, else ``mixed``. Rows without the CPU columns
(stores of schema version 5 and older) are not split: their time is ``unsplit_ms``, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from analyzers.source import Source
from tokentrace.schema import LOOP_LAGS, Role, Stage, col

__all__ = ["LoopLag", "loop_lag", "late_intervals_sql", "LATE_CAUSES", "SHARE", "CAUSE_MS", "BLOCKING",
           "OTHER_THREADS", "STARVED", "MIXED", "UNSPLIT_MS", "MAIN_CAUSE", "MAIN_CAUSE_SHARE"]

INSTANCE = "instance"
ROLE = "role"
NUM_LATE = "late_ticks"
LATE_MS = "late_ms"
LONGEST_MS = "longest_ms"
LATE_SHARE = "late_share"
STAGE = "stage"
STAGE_MS = "stage_ms"
IN_LATE_MS = "in_late_ms"
SHARE_IN_LATE = "share_in_late"
BLOCKING = "blocking"
OTHER_THREADS = "other_threads"
STARVED = "starved"
MIXED = "mixed"
LATE_CAUSES: tuple[str, ...] = (BLOCKING, OTHER_THREADS, STARVED)
"""The three reasons a loop runs late, in the order of their shares (see the module)."""
SHARE = {cause: f"{cause}_share" for cause in LATE_CAUSES}
"""Column of :func:`late_intervals_sql` with each cause's share of a late interval (null: not measured)."""
CAUSE_MS = {cause: f"{cause}_ms" for cause in LATE_CAUSES}
"""Column of :attr:`LoopLag.instances` with each cause's late time (ms)."""
UNSPLIT_MS = "unsplit_ms"
MAIN_CAUSE = "cause"
MAIN_CAUSE_SHARE = 0.5  # a cause holding at least half of an instance's measured late time names it


@dataclass(frozen=True, slots=True)
class LoopLag:
    """The two tables of :func:`loop_lag`; both empty when no loop was sampled."""

    instances: pd.DataFrame
    stages: pd.DataFrame

    @property
    def is_empty(self) -> bool:
        return len(self.instances) == 0


def late_intervals_sql() -> str:
    """SELECT of every ``loop_lags`` row: instance, start and end, and each cause's share of it
    (:data:`SHARE` columns; null where the row has no CPU times), by the module's rule."""
    c = col
    measured = f"{c.ARMED_NS} IS NOT NULL AND {c.LOOP_CPU_NS} IS NOT NULL AND {c.PROCESS_CPU_NS} IS NOT NULL"
    window = f"CAST(GREATEST({c.END_NS} - {c.ARMED_NS}, {c.END_NS} - {c.START_NS}, 1) AS DOUBLE)"
    loop = f"LEAST(GREATEST(CAST({c.LOOP_CPU_NS} AS DOUBLE) / {window}, 0.0), 1.0)"
    others = f"LEAST(GREATEST(CAST({c.PROCESS_CPU_NS} - {c.LOOP_CPU_NS} AS DOUBLE) / {window}, 0.0), 1.0 - {loop})"
    blocking, other, starved = (SHARE[k] for k in LATE_CAUSES)
    return f"""
        SELECT {c.INSTANCE_ID}, {c.START_NS}, {c.END_NS},
               CASE WHEN {measured} THEN {loop} END AS {blocking},
               CASE WHEN {measured} THEN {others} END AS {other},
               CASE WHEN {measured} THEN 1.0 - {loop} - {others} END AS {starved}
        FROM {LOOP_LAGS.name}"""


def _causes_per_instance(src: Source) -> pd.DataFrame:
    """Per instance: each cause's late time and the unsplit rest (ms)."""
    c = col
    sums = ", ".join(f"SUM(({c.END_NS} - {c.START_NS}) * {SHARE[k]}) / 1e6 AS {CAUSE_MS[k]}" for k in LATE_CAUSES)
    return src.df(f"""
        SELECT {c.INSTANCE_ID}, {sums},
               SUM(CASE WHEN {SHARE[BLOCKING]} IS NULL THEN {c.END_NS} - {c.START_NS} ELSE 0 END) / 1e6 AS {UNSPLIT_MS}
        FROM ({late_intervals_sql()}) GROUP BY {c.INSTANCE_ID}
    """)


def _main_cause(row: pd.Series) -> str:
    measured = sum(float(row[CAUSE_MS[k]]) for k in LATE_CAUSES if pd.notna(row[CAUSE_MS[k]]))
    if not measured > 0:
        return ""
    top = max(LATE_CAUSES, key=lambda k: float(row[CAUSE_MS[k]]) if pd.notna(row[CAUSE_MS[k]]) else 0.0)
    return top if float(row[CAUSE_MS[top]]) >= MAIN_CAUSE_SHARE * measured else MIXED


def loop_lag(src: Source) -> LoopLag:
    """How late each sampled loop ran, and how much of each stage's time it covers (see the module)."""
    c = col
    inst = src.df(f"""
        WITH lags AS (SELECT {c.INSTANCE_ID}, {c.START_NS} AS s, {c.END_NS} AS e FROM {LOOP_LAGS.name}),
        windows AS (
            SELECT {c.INSTANCE_ID}, MIN(s) AS lo, MAX(e) AS hi FROM (
                SELECT {c.INSTANCE_ID}, s, e FROM lags
                UNION ALL SELECT {c.INSTANCE_ID}, {c.START_NS}, {c.END_NS} FROM srv_spans
                WHERE {c.INSTANCE_ID} IN (SELECT {c.INSTANCE_ID} FROM lags)
            ) GROUP BY {c.INSTANCE_ID}
        )
        SELECT l.{c.INSTANCE_ID}, COALESCE(i.{c.NAME}, CAST(l.{c.INSTANCE_ID} AS VARCHAR)) AS {INSTANCE},
               i.{c.ROLE} AS role_id, COUNT(*) AS {NUM_LATE}, SUM(e - s) / 1e6 AS {LATE_MS},
               MAX(e - s) / 1e6 AS {LONGEST_MS}, SUM(e - s) / GREATEST(ANY_VALUE(w.hi - w.lo), 1) AS {LATE_SHARE}
        FROM lags l JOIN windows w USING ({c.INSTANCE_ID})
        LEFT JOIN instances i ON i.{c.INSTANCE_ID} = l.{c.INSTANCE_ID}
        GROUP BY l.{c.INSTANCE_ID}, i.{c.NAME}, i.{c.ROLE} ORDER BY {LATE_MS} DESC
    """)
    causes = _causes_per_instance(src)
    inst = inst.merge(causes, on=c.INSTANCE_ID, how="left")
    inst[MAIN_CAUSE] = [_main_cause(r) for _, r in inst.iterrows()] if len(inst) else pd.Series(dtype=str)
    if len(inst) == 0:
        empty_stages = pd.DataFrame({STAGE: pd.Series(dtype=str), STAGE_MS: pd.Series(dtype=float),
                                     IN_LATE_MS: pd.Series(dtype=float), SHARE_IN_LATE: pd.Series(dtype=float)})
        return LoopLag(inst.drop(columns=[c.INSTANCE_ID, "role_id"]).assign(**{ROLE: pd.Series(dtype=str)}),
                       empty_stages)
    inst.insert(2, ROLE, [Role(int(r)).label if pd.notna(r) else "" for r in inst["role_id"]])
    inst = inst.drop(columns=[c.INSTANCE_ID, "role_id"])
    stages = src.df(f"""
        WITH lags AS (SELECT {c.INSTANCE_ID}, {c.START_NS} AS ls, {c.END_NS} AS le FROM {LOOP_LAGS.name}),
        sp AS (
            SELECT {c.INSTANCE_ID}, {c.STAGE}, {c.START_NS} AS ss, {c.END_NS} AS se FROM srv_spans
            WHERE {c.INSTANCE_ID} IN (SELECT DISTINCT {c.INSTANCE_ID} FROM lags) AND {c.END_NS} > {c.START_NS}
        ),
        total AS (SELECT {c.STAGE}, SUM(se - ss) AS ns FROM sp GROUP BY {c.STAGE}),
        inside AS (
            SELECT sp.{c.STAGE}, SUM(LEAST(se, le) - GREATEST(ss, ls)) AS ns
            FROM sp JOIN lags ON sp.{c.INSTANCE_ID} = lags.{c.INSTANCE_ID} AND ss < le AND ls < se
            GROUP BY sp.{c.STAGE}
        )
        SELECT t.{c.STAGE}, t.ns / 1e6 AS {STAGE_MS}, COALESCE(i.ns, 0) / 1e6 AS {IN_LATE_MS}
        FROM total t LEFT JOIN inside i USING ({c.STAGE})
    """)
    order = {int(s): k for k, s in enumerate(Stage)}
    stages = stages.assign(_order=stages[c.STAGE].map(lambda v: order[int(v)])).sort_values("_order")
    stages.insert(0, STAGE, [Stage(int(v)).label for v in stages[c.STAGE]])
    stages[SHARE_IN_LATE] = stages[IN_LATE_MS] / stages[STAGE_MS].where(stages[STAGE_MS] > 0)
    return LoopLag(inst.reset_index(drop=True),
                   stages[[STAGE, STAGE_MS, IN_LATE_MS, SHARE_IN_LATE]].reset_index(drop=True))
