"""The attribution invariant's gauges: unattributed time (signed) and overlap, per kind of token.

For every delivered token (intervals as in :mod:`analyzers.timing`) its spans
are clipped to the token's interval (as :func:`analyzers.stage_breakdown.token_spans`):

* stage time = the sum of the clipped span lengths (what the stage shares add up);
* covered time = the length of their union (time at least one stage claims);
* ``unattributed`` = latency - stage time, **signed**: positive when no stage covers
  part of the token, negative when stages claim more than the token's time;
* ``overlap`` = stage time - covered time >= 0: time two or more stages both claim
  (double-counted), its own figure;
* ``uncovered`` = latency - covered time = unattributed + overlap: time no stage covers.

Shares are over the summed latency of the tokens of the kind (``ttft``: token 0,
``itl``: tokens i >= 1, ``all``). Neither figure is floored or hidden: the invariant
asks |unattributed| < 1% and overlap < 1%.
"""

from __future__ import annotations

import math

import pandas as pd

from analyzers import facts
from analyzers.source import Source
from analyzers.timing import LATENCY, TOKEN_END, TOKEN_START, token_times
from tokentrace.schema import col

__all__ = ["KINDS", "token_coverage", "attribution", "unattributed_share", "overlap_share"]

KINDS: tuple[str, ...] = ("ttft", "itl", "all")
COLUMNS = ["kind", "num_tokens", "latency_ms", "stage_ms", "covered_ms", "unattributed_share", "overlap_share",
           "uncovered_share"]


def token_coverage(src: Source) -> str:
    """Name of the temp table with one row per delivered token: request_id, token_index, latency_ns,
    stage_ns (sum of clipped spans), covered_ns (union of clipped spans)."""
    def build() -> str:
        c = col
        derived = facts.view(src, "token_stage_ns")  # the run's derived facts hold these columns (analyzers.facts)
        if derived is not None:
            return derived
        src.execute(f"""
            CREATE OR REPLACE TEMP TABLE token_coverage AS
            WITH clipped AS (
                SELECT s.{c.REQUEST_ID}, s.{c.TOKEN_INDEX},
                       GREATEST(s.{c.START_NS}, t.{TOKEN_START}) AS lo, LEAST(s.{c.END_NS}, t.{TOKEN_END}) AS hi
                FROM srv_spans s JOIN {token_times(src)} t USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
            ), pieces AS (
                SELECT *, MAX(hi) OVER (PARTITION BY {c.REQUEST_ID}, {c.TOKEN_INDEX} ORDER BY lo, hi
                                        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach
                FROM clipped WHERE hi > lo
            ), per_token AS (
                SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, SUM(hi - lo) AS stage_ns,
                       SUM(GREATEST(0, hi - GREATEST(lo, COALESCE(reach, lo)))) AS covered_ns
                FROM pieces GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
            )
            SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{LATENCY} AS latency_ns,
                   COALESCE(p.stage_ns, 0) AS stage_ns, COALESCE(p.covered_ns, 0) AS covered_ns
            FROM {token_times(src)} t LEFT JOIN per_token p USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
        """)
        return "token_coverage"
    return src.cached("token_coverage", build)


def attribution(src: Source) -> pd.DataFrame:
    """Rows ``ttft``, ``itl`` and ``all``: num_tokens, latency_ms, stage_ms, covered_ms (sums), and
    unattributed_share (signed), overlap_share, uncovered_share (NaN for a kind with no latency)."""
    c = col
    df = src.df(f"""
        SELECT CASE WHEN {c.TOKEN_INDEX} = 0 THEN 'ttft' ELSE 'itl' END AS kind, COUNT(*) AS num_tokens,
               SUM(latency_ns)::DOUBLE AS lat, SUM(stage_ns)::DOUBLE AS stage, SUM(covered_ns)::DOUBLE AS covered
        FROM {token_coverage(src)} GROUP BY ALL
    """).set_index("kind")
    rows = []
    for kind in KINDS:
        part = df if kind == "all" else df.loc[[k for k in df.index if k == kind]]
        n = int(part["num_tokens"].sum()) if len(part) else 0
        lat, stage, covered = (float(part[k].sum()) if len(part) else 0.0 for k in ("lat", "stage", "covered"))
        share = (lambda x: x / lat if lat > 0 else math.nan)
        rows.append({"kind": kind, "num_tokens": n, "latency_ms": lat / 1e6, "stage_ms": stage / 1e6,
                     "covered_ms": covered / 1e6, "unattributed_share": share(lat - stage),
                     "overlap_share": share(stage - covered), "uncovered_share": share(lat - covered)})
    return pd.DataFrame(rows, columns=COLUMNS)


def _all_row(src: Source, column: str) -> float:
    value = float(attribution(src).set_index("kind").loc["all", column])
    return value if math.isfinite(value) else 0.0


def unattributed_share(src: Source) -> float:
    """Signed unattributed time over all token latency (0 with no tokens): latency minus stage time."""
    return _all_row(src, "unattributed_share")


def overlap_share(src: Source) -> float:
    """Double-counted stage time over all token latency (0 with no tokens)."""
    return _all_row(src, "overlap_share")
