"""Test helper: per-token stage time of a served run, spans clipped to token intervals.

A served token's spans come from several processes and the engine runs ahead of
the stream, so a span may start before its token's interval (see
``instrument/reference_gateway.py``). The attribution invariant is checked on
the clipped spans: ``covered = sum(len(span ∩ token interval))`` per stage.
All times are aligned to the run's reference clock first (``tokentrace.clock.align``).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa

from analyzers.timing import LATENCY, TOKEN_END, TOKEN_START, token_intervals
from tokentrace.clock import align
from tokentrace.schema import SPANS, Stage, col
from tokentrace.store import open_run

TABLES = ("spans", "requests", "tokens", "instances", "steps", "cache_events")


def load(store: Path, run: str) -> dict[str, pa.Table]:
    r = open_run(store, run)
    return {name: r.table(name) for name in TABLES}


def clipped_stage_times(t: dict[str, pa.Table], *, aligned: bool = True) -> pd.DataFrame:
    """One row per delivered token: latency, ns per stage label (clipped) and ``unattributed``."""
    inst = t["instances"]
    if not aligned:  # pretend every offset is 0
        inst = inst.set_column(inst.schema.get_field_index(col.CLOCK_OFFSET_NS), col.CLOCK_OFFSET_NS,
                               pa.array([0] * inst.num_rows, pa.int64()))
    ti = token_intervals(t["requests"], t["tokens"], inst)
    sp = align(t["spans"], SPANS.name, inst).to_pandas()
    sp = sp[sp[col.TOKEN_INDEX] >= 0]
    m = sp.merge(ti, on=[col.REQUEST_ID, col.TOKEN_INDEX], how="inner")
    lo = m[[col.START_NS, TOKEN_START]].max(axis=1)
    hi = m[[col.END_NS, TOKEN_END]].min(axis=1)
    m["ns"] = (hi - lo).clip(lower=0)
    wide = m.pivot_table(index=[col.REQUEST_ID, col.TOKEN_INDEX], columns=col.STAGE, values="ns",
                         aggfunc="sum", fill_value=0)
    wide.columns = [Stage(int(s)).label for s in wide.columns]
    out = ti.merge(wide.reset_index(), on=[col.REQUEST_ID, col.TOKEN_INDEX], how="left")
    labels = [s.label for s in Stage]
    for label in labels:
        out[label] = out[label].fillna(0).astype("int64") if label in out else 0
    out["unattributed"] = out[LATENCY] - out[labels].sum(axis=1)
    return out


def unattributed_share(times: pd.DataFrame) -> float:
    """|unattributed| summed over tokens / total token latency (overlap counts as error too)."""
    return float(times["unattributed"].abs().sum() / times[LATENCY].sum())


def stage_means_ms(times: pd.DataFrame, token_kind: str) -> pd.Series:
    """Mean ms per stage over token 0 (``ttft``) or tokens >= 1 (``itl``)."""
    rows = times[times[col.TOKEN_INDEX] == 0] if token_kind == "ttft" else times[times[col.TOKEN_INDEX] > 0]
    return rows[[s.label for s in Stage] + ["unattributed"]].mean() / 1e6


def handover_ns(t: dict[str, pa.Table], times: pd.DataFrame) -> pd.Series:
    """Per token: time not covered where one process's spans end and another's begin.

    Walking a token's (aligned, clipped) spans in time order, a gap or an overlap
    between spans of two different processes is a cross-process hand-over (the
    token interval's own ends count as the gateway's, which defines them): its
    length is added (an overlap subtracted). Gaps between spans of one process
    are not hand-overs. Unattributed time should be exactly this.
    """
    inst = t["instances"]
    sp = align(t["spans"], SPANS.name, inst).to_pandas()
    sp = sp[sp[col.TOKEN_INDEX] >= 0]
    key = [col.REQUEST_ID, col.TOKEN_INDEX]
    m = sp.merge(times[key + [TOKEN_START, TOKEN_END]], on=key)
    m[col.START_NS] = m[[col.START_NS, TOKEN_START]].max(axis=1)
    m[col.END_NS] = m[[col.END_NS, TOKEN_END]].min(axis=1)
    m = m[m[col.END_NS] > m[col.START_NS]].sort_values(key + [col.START_NS])
    out: dict[tuple[int, int], int] = {}
    for k, g in m.groupby(key):
        cursor, owner, total = int(g[TOKEN_START].iloc[0]), None, 0
        for start, end, who in zip(g[col.START_NS], g[col.END_NS], g[col.INSTANCE_ID]):
            if start >= cursor:
                if owner is None or who != owner:  # a gap at a hand-over (or from the token's start)
                    total += start - cursor
                cursor, owner = end, who
            else:  # overlaps what is covered already: counted twice in the stage sums
                total -= min(end, cursor) - start
                if end > cursor:
                    cursor, owner = end, who
        total += int(g[TOKEN_END].iloc[0]) - cursor
        out[k] = total
    return pd.Series(out, dtype="float64").reindex(times.set_index(key).index).fillna(times.set_index(key)[LATENCY])
