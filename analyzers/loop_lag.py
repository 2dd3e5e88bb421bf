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
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from analyzers.source import Source
from tokentrace.schema import LOOP_LAGS, Role, Stage, col

__all__ = ["LoopLag", "loop_lag"]

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


@dataclass(frozen=True, slots=True)
class LoopLag:
    """The two tables of :func:`loop_lag`; both empty when no loop was sampled."""

    instances: pd.DataFrame
    stages: pd.DataFrame

    @property
    def is_empty(self) -> bool:
        return len(self.instances) == 0


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
