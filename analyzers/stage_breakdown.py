"""Where the time went: each stage's share of TTFT and of inter-token latency.

For every output token (intervals as in :mod:`analyzers.timing`) the stage time
is the sum of the durations of its spans (``spans.token_index`` = the token);
``unattributed`` = token latency - stage time, so shares always add up to 1.

* ``ttft_share(s)``  = sum over requests of s's time in token 0 / sum of TTFTs.
* ``itl_share(s)``   = the same over tokens i >= 1 and their ITLs.
* ``*_tail_share(s)`` = the same ratio over the slowest 1% of those tokens (at
  least one token): what the tail spent its time on.
* ``*_mean_ms(s)``   = s's time per token, averaged over all tokens of the kind.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from analyzers.align import align
from analyzers.timing import LATENCY, connect, token_intervals
from tokentrace.schema import SPANS, UNATTRIBUTED_LABEL, Stage, col

__all__ = ["token_stage_times", "stage_breakdown", "unattributed_share"]

TAIL_FRACTION = 0.01


def token_stage_times(spans: pa.Table, requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """Wide table: one row per token, its latency and one column of ns per stage label + unattributed."""
    ti = token_intervals(requests, tokens, instances)
    sp = align(spans, SPANS.name, instances)
    con = connect(sp=sp)
    c = col
    per = con.execute(f"""
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, {c.STAGE}, SUM({c.END_NS} - {c.START_NS}) AS ns
        FROM sp WHERE {c.TOKEN_INDEX} >= 0
        GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}, {c.STAGE}
    """).df()
    wide = per.pivot_table(index=[c.REQUEST_ID, c.TOKEN_INDEX], columns=c.STAGE, values="ns",
                           aggfunc="sum", fill_value=0)
    wide.columns = [Stage(int(s)).label for s in wide.columns]
    out = ti.merge(wide.reset_index(), on=[c.REQUEST_ID, c.TOKEN_INDEX], how="left")
    labels = [s.label for s in Stage]
    for label in labels:
        out[label] = out[label].fillna(0).astype("int64") if label in out else 0
    out[UNATTRIBUTED_LABEL] = out[LATENCY] - out[labels].sum(axis=1)
    return out


def _shares(rows: pd.DataFrame, labels: list[str]) -> pd.Series:
    total = rows[LATENCY].sum()
    if total <= 0:
        return pd.Series(np.nan, index=labels)
    return rows[labels].sum() / total


def stage_breakdown(spans: pa.Table, requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """One row per stage (plus ``unattributed``): mean ms and share of TTFT and ITL, mean and tail."""
    t = token_stage_times(spans, requests, tokens, instances)
    labels = [s.label for s in Stage] + [UNATTRIBUTED_LABEL]
    result = pd.DataFrame({"stage": labels})
    for kind, rows in (("ttft", t[t[col.TOKEN_INDEX] == 0]), ("itl", t[t[col.TOKEN_INDEX] > 0])):
        n_tail = max(1, int(np.ceil(len(rows) * TAIL_FRACTION))) if len(rows) else 0
        tail = rows.nlargest(n_tail, LATENCY)
        result[f"{kind}_mean_ms"] = (rows[labels].mean() / 1e6).to_numpy() if len(rows) else np.nan
        result[f"{kind}_share"] = _shares(rows, labels).to_numpy()
        result[f"{kind}_tail_share"] = _shares(tail, labels).to_numpy()
    return result


def unattributed_share(spans: pa.Table, requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> float:
    """Unattributed time over total token latency (0..1): the attribution invariant's gauge."""
    t = token_stage_times(spans, requests, tokens, instances)
    total = t[LATENCY].sum()
    return float(t[UNATTRIBUTED_LABEL].clip(lower=0).sum() / total) if total > 0 else 0.0
