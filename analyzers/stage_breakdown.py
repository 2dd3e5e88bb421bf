"""Where the time went: each stage's share of TTFT and of inter-token latency.

For every output token (intervals as in :mod:`analyzers.timing`) the stage time
is the sum of the durations of its spans (``spans.token_index`` = the token),
each clipped to the token's interval (:func:`token_spans`);
``unattributed`` = token latency - stage time (signed, never floored), so shares
always add up to 1; time two stages both claim is reported apart, as overlap
(:mod:`analyzers.attribution`).

* ``ttft_share(s)``  = sum over requests of s's time in token 0 / sum of TTFTs.
* ``itl_share(s)``   = the same over tokens i >= 1 and their ITLs.
* ``*_tail_share(s)`` = the same ratio over the slowest 1% of those tokens
  (ceil(1% of n), at least one token): what the tail spent its time on.
* ``*_mean_ms(s)``   = s's time per token, averaged over all tokens of the kind.

The aggregation runs in DuckDB as one pass over the spans (joined to the
per-token facts), so it streams over stores bigger than memory.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from analyzers import facts
from analyzers.attribution import unattributed_share as signed_unattributed_share
from analyzers.groups import group_column, group_sql
from analyzers.source import Source
from analyzers.timing import LATENCY, TOKEN_END, TOKEN_START, request_table, run_bounds, token_intervals, token_times
from tokentrace.schema import UNATTRIBUTED_LABEL, Stage, col

__all__ = ["TAIL_FRACTION", "STAGE_LABELS", "ROW_OF_STAGE", "token_spans", "breakdown", "unattributed", "token_stage_times", "stage_breakdown",
           "unattributed_share"]

TAIL_FRACTION = 0.01
STAGE_LABELS: list[str] = [s.label for s in Stage] + [UNATTRIBUTED_LABEL]
ROW_OF_STAGE: np.ndarray = np.zeros(max(int(s) for s in Stage) + 1, dtype=np.int64)
"""Stage value -> its row in :data:`STAGE_LABELS` (stages are listed in pipeline order, not by value)."""
for _row, _stage in enumerate(Stage):
    ROW_OF_STAGE[int(_stage)] = _row
"""Row order of a breakdown: every stage in schema order, then ``unattributed``."""
_KINDS = ("ttft", "itl")


def _tokens_sql(src: Source, g: str) -> str:
    """SQL of every delivered token: request, index, interval (t0, t1), latency (lat), group (grp), first?.

    Without a grouping this is a view of :func:`analyzers.timing.token_times`; with one, the tokens are joined
    to their request's group once, into the temp table ``bd_tok``."""
    c = col
    tt = token_times(src)
    columns = f"{c.REQUEST_ID}, {c.TOKEN_INDEX}, {TOKEN_START} AS t0, {TOKEN_END} AS t1, {LATENCY} AS lat"
    if g == "0":
        return f"SELECT {columns}, 0 AS grp, {c.TOKEN_INDEX} = 0 AS first FROM {tt}"
    src.execute(f"""
        CREATE OR REPLACE TEMP TABLE bd_tok AS
        SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{TOKEN_START} AS t0, t.{TOKEN_END} AS t1, t.{LATENCY} AS lat,
               {g} AS grp, t.{c.TOKEN_INDEX} = 0 AS first
        FROM {tt} t JOIN {request_table(src)} f USING ({c.REQUEST_ID})
    """)
    return "SELECT * FROM bd_tok"


def _tail_cuts(src: Source, tokens: str, tail_fraction: float) -> None:
    """Temp table ``bd_cut``: per (group, kind), the last token of its tail: the k-th slowest of its n tokens,
    k = ceil(tail_fraction * n) (at least 1), ties ordered by request id then token index.

    A token is in the tail when it ranks at or before that one (:data:`_IN_TAIL`): no table of tail tokens is
    joined to the spans. Candidates first (>= a quantile that keeps at least twice the tail), then the exact
    rank: ranking only the candidates avoids sorting every token."""
    c = col
    q = max(0.0, 1.0 - 2.0 * tail_fraction)
    src.execute(f"""
        CREATE OR REPLACE TEMP TABLE bd_cut AS
        WITH tok AS ({tokens}),
        q AS (SELECT grp, first, COUNT(*) AS n, quantile_disc(lat, {q}) AS cut FROM tok GROUP BY grp, first),
        ranked AS (
            SELECT b.grp, b.first, b.lat, b.{c.REQUEST_ID}, b.{c.TOKEN_INDEX}, q.n,
                   ROW_NUMBER() OVER (PARTITION BY b.grp, b.first
                                      ORDER BY b.lat DESC, b.{c.REQUEST_ID}, b.{c.TOKEN_INDEX}) AS rank
            FROM tok b JOIN q ON b.grp IS NOT DISTINCT FROM q.grp AND b.first = q.first
            WHERE b.lat >= q.cut
        )
        SELECT grp, first, lat AS cut_lat, {c.REQUEST_ID} AS cut_request, {c.TOKEN_INDEX} AS cut_index
        FROM ranked WHERE rank = GREATEST(1, CEIL(n * {tail_fraction}))
    """)


_IN_TAIL = (f"(k.lat > u.cut_lat OR (k.lat = u.cut_lat AND (k.{col.REQUEST_ID} < u.cut_request "
            f"OR (k.{col.REQUEST_ID} = u.cut_request AND k.{col.TOKEN_INDEX} <= u.cut_index))))")
"""True for a token (alias ``k``) ranked at or before its group's tail cut (alias ``u``, a ``bd_cut`` row)."""


def _with_tail(tokens: str) -> str:
    """``tokens`` with a ``tail`` column, from the cuts in ``bd_cut``."""
    return (f"SELECT k.*, {_IN_TAIL} AS tail FROM ({tokens}) k "
            f"JOIN bd_cut u ON k.grp IS NOT DISTINCT FROM u.grp AND k.first = u.first")


def token_spans(src: Source) -> str:
    """Name of the temp table of span time inside each delivered token's interval.

    Columns: request_id, token_index, stage_id, ns. Each span counts only for its
    overlap with its token's interval ``[token_start_ns, token_end_ns]`` on the
    reference clock. In one process that is the whole span; across processes the
    engine runs ahead of the stream (it computes token i while the gateway still
    sends token i-1), and the part of a span hidden behind the previous token's
    delivery is not part of this token's latency.
    """
    def build() -> str:
        c = col
        src.execute(f"""
            CREATE OR REPLACE TEMP TABLE token_spans AS
            SELECT s.{c.REQUEST_ID}, s.{c.TOKEN_INDEX}, s.{c.STAGE},
                   GREATEST(0, LEAST(s.{c.END_NS}, t.{TOKEN_END}) - GREATEST(s.{c.START_NS}, t.{TOKEN_START})) AS ns
            FROM srv_spans s JOIN {token_times(src)} t USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
        """)
        return "token_spans"
    return src.cached("token_spans", build)


def _stage_sums(src: Source, tailed: str, *, grouped: bool) -> pd.DataFrame:
    """Per (group, kind, stage): summed in-interval span time of the delivered tokens and of the tail tokens.

    One pass: each span joined to its token (``tailed``: the tokens with their tail flag) and clipped to the
    token's interval as :func:`token_spans` does, summed straight into the few result rows (no per-span table
    is written)."""
    c = col
    clipped = f"GREATEST(0, LEAST(s.{c.END_NS}, k.t1) - GREATEST(s.{c.START_NS}, k.t0))"
    # Only what the sums need crosses the join: without a grouping the group is the constant 0, and whether a
    # token is the first is known from the span's own token index.
    grp = "k.grp" if grouped else "0"
    build = tailed if grouped else f"(SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, t0, t1, tail FROM {tailed})"
    return src.df(f"""
        SELECT {grp} AS grp, s.{c.TOKEN_INDEX} = 0 AS first, s.{c.STAGE} AS stage,
               SUM({clipped})::DOUBLE AS ns, COALESCE(SUM({clipped}) FILTER (WHERE k.tail), 0)::DOUBLE AS tail_ns
        FROM srv_spans s
        JOIN {build} k ON s.{c.REQUEST_ID} = k.{c.REQUEST_ID} AND s.{c.TOKEN_INDEX} = k.{c.TOKEN_INDEX}
        GROUP BY ALL
    """).assign(kind=lambda f: np.where(f["first"].astype(bool), "ttft", "itl"))


def token_stage_sql(src: Source, stages: list[int]) -> str:
    """SELECT of one row per delivered token: request_id, token_index and, per stage id in ``stages``, its
    spans' time inside the token's interval summed (``stage_<id>_ns``, 0 without such a span): the rows of
    :func:`token_spans` summed per token and stage, one column per stage."""
    c = col
    clipped = f"GREATEST(0, LEAST(s.{c.END_NS}, t.{TOKEN_END}) - GREATEST(s.{c.START_NS}, t.{TOKEN_START}))"
    sums = ", ".join(f"SUM(CASE WHEN s.{c.STAGE} = {int(st)} THEN {clipped} ELSE 0 END) AS {facts.stage_column(st)}"
                     for st in stages)
    return f"""
        SELECT s.{c.REQUEST_ID}, s.{c.TOKEN_INDEX}{", " + sums if sums else ""}
        FROM srv_spans s JOIN {token_times(src)} t USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
        GROUP BY s.{c.REQUEST_ID}, s.{c.TOKEN_INDEX}
    """


def _derived_stages(src: Source, derived: str) -> list[int]:
    """Stage ids with a column in the derived per-token stage sums (stages the run's spans have)."""
    prefix, suffix = facts.STAGE_COLUMN_PREFIX, "_ns"
    return [int(name[len(prefix):-len(suffix)]) for name in src.engine.columns(derived)
            if name.startswith(prefix) and name.endswith(suffix) and name[len(prefix):-len(suffix)].isdigit()]


def _derived_tokens_sql(src: Source, g: str, derived: str, stages: list[int]) -> str:
    """As :func:`_tokens_sql` (without the intervals, which the derived sums no longer need), from the derived
    per-token stage sums, each token with its stage columns."""
    c = col
    stage_cols = "".join(f", w.{facts.stage_column(st)}" for st in stages)
    columns = f"w.{c.REQUEST_ID}, w.{c.TOKEN_INDEX}, w.{LATENCY} AS lat, {g} AS grp, w.{c.TOKEN_INDEX} = 0 AS first"
    if g == "0":
        return f"SELECT {columns}{stage_cols} FROM {derived} w"
    return f"SELECT {columns}{stage_cols} FROM {derived} w JOIN {request_table(src)} f USING ({c.REQUEST_ID})"


def _derived_stage_sums(src: Source, tokens: str, stages: list[int]) -> pd.DataFrame:
    """:func:`_stage_sums` from the derived per-token stage sums: the same integers summed per (group, kind)."""
    parts = []
    for i, st in enumerate(stages):
        name = f"k.{facts.stage_column(st)}"
        parts.append(f"SUM({name})::DOUBLE AS ns_{i}, COALESCE(SUM({name}) FILTER (WHERE k.tail), 0)::DOUBLE AS tail_{i}")
    wide = src.df(f"SELECT k.grp, k.first{''.join(', ' + p for p in parts)} FROM ({_with_tail(tokens)}) k "
                  f"GROUP BY k.grp, k.first")
    rows = [{"grp": r["grp"], "first": r["first"], "stage": st, "ns": r[f"ns_{i}"], "tail_ns": r[f"tail_{i}"]}
            for r in wide.to_dict("records") for i, st in enumerate(stages)]
    per = pd.DataFrame(rows, columns=["grp", "first", "stage", "ns", "tail_ns"])
    return per.assign(kind=np.where(per["first"].astype(bool), "ttft", "itl"))


def breakdown(src: Source, *, by: str | None = None, window_s: float | None = None,
              tail_fraction: float = TAIL_FRACTION) -> pd.DataFrame:
    """One row per stage (plus ``unattributed``) and group: mean ms and share of TTFT and ITL, mean and tail.

    Columns: [group column], stage, ttft_mean_ms, ttft_share, ttft_tail_share,
    itl_mean_ms, itl_share, itl_tail_share. Shares are NaN for a kind with no
    tokens. ``by`` / ``window_s`` as :func:`analyzers.latency.latency`.
    """
    if not 0 < tail_fraction <= 1:
        raise ValueError(f"tail_fraction must be in (0, 1], got {tail_fraction!r}")
    gcol = group_column(by, window_s)
    start = None
    if window_s is not None:
        b = run_bounds(src)
        start = b[0] if b else 0
    g = group_sql(by, window_s, alias="f", start_ns=start)
    derived = facts.view(src, "token_stage_ns")  # per-token stage sums of the run's derived facts
    stages = _derived_stages(src, derived) if derived is not None else []
    tokens = _tokens_sql(src, g) if derived is None else _derived_tokens_sql(src, g, derived, stages)
    _tail_cuts(src, tokens, tail_fraction)
    tailed = f"({_with_tail(tokens)})"
    if derived is None:  # the tokens with their tail flag once, for the totals and for the join to the spans
        src.execute(f"CREATE OR REPLACE TEMP TABLE token_tail AS {_with_tail(tokens)}")
        tailed = "token_tail"
    tot = src.df(f"""
        SELECT grp, CASE WHEN first THEN 'ttft' ELSE 'itl' END AS kind, COUNT(*) AS n,
               SUM(lat)::DOUBLE AS lat, SUM(lat) FILTER (WHERE tail)::DOUBLE AS tail_lat
        FROM {tailed} GROUP BY grp, first
    """)
    per = _stage_sums(src, tailed, grouped=g != "0") if derived is None else _derived_stage_sums(src, tokens, stages)
    src.execute("DROP TABLE IF EXISTS bd_tok; DROP TABLE IF EXISTS bd_cut; DROP TABLE IF EXISTS token_tail")
    groups = sorted(tot["grp"].unique().tolist()) if gcol is not None else [0]
    frames = []
    for grp in groups:
        frame = _assemble(tot[tot["grp"] == grp], per[per["grp"] == grp])
        if gcol is not None:
            frame.insert(0, gcol, grp)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def _assemble(tot: pd.DataFrame, per: pd.DataFrame) -> pd.DataFrame:
    """The per-stage rows of one group from its token totals and per-stage sums."""
    result = pd.DataFrame({"stage": STAGE_LABELS})
    for kind in _KINDS:
        t = tot[tot["kind"] == kind]
        n = int(t["n"].iloc[0]) if len(t) else 0
        lat = float(t["lat"].iloc[0]) if len(t) else 0.0
        tail_lat = float(t["tail_lat"].iloc[0]) if len(t) else 0.0
        p = per[per["kind"] == kind]
        ns = np.zeros(len(STAGE_LABELS))
        tail = np.zeros(len(STAGE_LABELS))
        for stage, v, tv in zip(p["stage"], p["ns"], p["tail_ns"]):
            ns[ROW_OF_STAGE[int(stage)]] += v
            tail[ROW_OF_STAGE[int(stage)]] += tv
        ns[-1] = lat - ns[:-1].sum()
        tail[-1] = tail_lat - tail[:-1].sum()
        result[f"{kind}_mean_ms"] = ns / n / 1e6 if n else np.nan
        result[f"{kind}_share"] = ns / lat if lat > 0 else np.nan
        result[f"{kind}_tail_share"] = tail / tail_lat if tail_lat > 0 else np.nan
    return result[["stage"] + [f"{k}_{m}" for k in _KINDS for m in ("mean_ms", "share", "tail_share")]]


def unattributed(src: Source) -> float:
    """Unattributed time over total token latency, signed: the attribution invariant's gauge.

    Summed over tokens, latency minus stage time (no token is floored at 0: stages
    that claim more than a token's time make it negative), over the sum of token
    latencies; 0 with no tokens. Double-counted time is its own figure:
    :func:`analyzers.attribution.overlap_share`.
    """
    return signed_unattributed_share(src)


def token_stage_times(spans: pa.Table, requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """Wide table: one row per token, its latency and one column of ns per stage label + unattributed.

    For small in-memory tables (it is one row per token).
    """
    src = Source.of_tables(spans=spans, requests=requests, tokens=tokens, instances=instances)
    ti = token_intervals(requests, tokens, instances)
    c = col
    per = src.df(f"""
        SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, {c.STAGE}, SUM(ns) AS ns
        FROM {token_spans(src)} GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}, {c.STAGE}
    """)
    out = ti
    if len(per):
        wide = per.pivot_table(index=[c.REQUEST_ID, c.TOKEN_INDEX], columns=c.STAGE, values="ns",
                               aggfunc="sum", fill_value=0)
        wide.columns = [Stage(int(s)).label for s in wide.columns]
        out = ti.merge(wide.reset_index(), on=[c.REQUEST_ID, c.TOKEN_INDEX], how="left")
    labels = [s.label for s in Stage]
    for label in labels:
        out[label] = out[label].fillna(0).astype("int64") if label in out else 0
    out[UNATTRIBUTED_LABEL] = out[LATENCY] - out[labels].sum(axis=1)
    return out


def stage_breakdown(spans: pa.Table, requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """:func:`breakdown` (no grouping) over in-memory Arrow tables."""
    return breakdown(Source.of_tables(spans=spans, requests=requests, tokens=tokens, instances=instances))


def unattributed_share(spans: pa.Table, requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> float:
    """:func:`unattributed` over in-memory Arrow tables."""
    value = unattributed(Source.of_tables(spans=spans, requests=requests, tokens=tokens, instances=instances))
    return value if math.isfinite(value) else 0.0
