"""Where the time went: each stage's share of TTFT and of inter-token latency.

For every output token (intervals as in :mod:`analyzers.timing`: TTFT ends at the
first visible content) the stage time is the time of the spans that count in its
interval, clipped (:func:`analyzers.attribution.span_pieces_sql`: whatever token
index their process gave them);
``unattributed`` = token latency - stage time (signed, never floored), so shares
always add up to 1; time two stages both claim is reported apart, as overlap
(:mod:`analyzers.attribution`).

* ``ttft_share(s)``  = sum over requests of s's time in token 0 / sum of TTFTs.
* ``itl_share(s)``   = the same over tokens i >= 1 and their ITLs.
* ``*_tail_share(s)`` = the same ratio over the slowest 1% of those tokens
  (ceil(1% of n), at least one token): what the tail spent its time on.
* ``*_mean_ms(s)``   = s's time per token, averaged over all tokens of the kind.

The aggregation reads the derived fact :data:`TOKEN_STAGE_NS` (one row per token
with its clipped stage sums, :func:`analyzers.facts.relation`: the run's saved copy or
built now in one pass over the spans), so it streams over stores bigger than memory.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from analyzers import facts
from analyzers.attribution import span_pieces_sql, token_key_sql
from analyzers.attribution import unattributed_share as signed_unattributed_share
from analyzers.groups import group_column, group_sql
from analyzers.source import Source
from analyzers.timing import LATENCY, TOKEN_END, TOKEN_START, request_table, run_bounds, token_times
from tokentrace.schema import INSTANCES, SPANS, TOKENS, UNATTRIBUTED_LABEL, Stage, col

__all__ = ["TOKEN_STAGE_NS", "REQUEST_STAGE_NS", "token_stage_ns", "request_stage_ns", "stage_column",
           "TAIL_FRACTION", "STAGE_LABELS", "ROW_OF_STAGE", "token_spans", "breakdown", "unattributed",
           "token_stage_times", "stage_breakdown", "unattributed_share"]

TAIL_FRACTION = 0.01
STAGE_LABELS: list[str] = [s.label for s in Stage] + [UNATTRIBUTED_LABEL]
ROW_OF_STAGE: np.ndarray = np.zeros(max(int(s) for s in Stage) + 1, dtype=np.int64)
"""Stage value -> its row in :data:`STAGE_LABELS` (stages are listed in pipeline order, not by value)."""
for _row, _stage in enumerate(Stage):
    ROW_OF_STAGE[int(_stage)] = _row
"""Row order of a breakdown: every stage in schema order, then ``unattributed``."""
_KINDS = ("ttft", "itl")


def stage_column(stage: int) -> str:
    """The :data:`TOKEN_STAGE_NS` column of a stage id: ``stage_<id>_ns``."""
    return f"stage_{int(stage)}_ns"


def _token_stage_sql(src: Source, only: str | None = None) -> str:
    """Every delivered token (``only``: those of its (request_id, token_index) pairs) with its latency and, per
    stage, the time of the spans that count in its interval (:func:`analyzers.attribution.span_pieces_sql`),
    summed."""
    c = col
    tt = token_times(src)
    if only is not None:
        tt = (f"(SELECT t.* FROM {tt} t JOIN {only} k "
              f"ON k.{c.REQUEST_ID} = t.{c.REQUEST_ID} AND k.{c.TOKEN_INDEX} = t.{c.TOKEN_INDEX})")
    clipped = "GREATEST(0, p.hi - p.lo)"
    sums = ", ".join(f"SUM(CASE WHEN p.{c.STAGE} = {int(st)} THEN {clipped} ELSE 0 END) AS {stage_column(st)}"
                     for st in Stage)
    filled = ", ".join(f"COALESCE(w.{stage_column(st)}, 0) AS {stage_column(st)}" for st in Stage)
    return f"""
        SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{LATENCY}, {filled}
        FROM {tt} t LEFT JOIN (
            SELECT p.{c.REQUEST_ID}, p.{c.TOKEN_INDEX}, {sums}
            FROM ({span_pieces_sql(src, only)}) p
            GROUP BY p.{c.REQUEST_ID}, p.{c.TOKEN_INDEX}
        ) w USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
    """


TOKEN_STAGE_NS = facts.Fact(
    "token_stage_ns", "One row per delivered token: its latency and, per stage, the time of its spans inside its "
                      "interval summed (0 without such a span; :func:`token_spans`).",
    (TOKENS.column(col.REQUEST_ID), TOKENS.column(col.TOKEN_INDEX),
     facts.i64(LATENCY, "The token's latency (TTFT for token 0, else ITL); ns."),
     *(facts.i64(stage_column(st), f"{st.label}: its spans' time inside the token's interval; ns.") for st in Stage)),
    select=_token_stage_sql, keys=(col.REQUEST_ID, col.TOKEN_INDEX), select_only=_token_stage_sql)


def _build_request_stage_ns(src: Source, table: str) -> None:
    """Materialize :data:`REQUEST_STAGE_NS` as ``table``: the spans' clipped time
    (:func:`analyzers.attribution.span_pieces_sql`) summed per request, stage and role of the recording instance,
    in one pass over the spans. Each group's sums are BIGINT: every piece is >= 0, so a group's sum is at most its
    request's, which the fact declares BIGINT (an overflow raises either way)."""
    c = col
    role, instances = _role_sql(src, f"p.{c.INSTANCE_ID}")
    first = f"p.{c.TOKEN_INDEX} = 0 AND p.hi > p.lo"
    summed = f"""(
        SELECT p.{c.REQUEST_ID}, p.{c.STAGE}, CASE WHEN {role} >= 0 THEN {role} END AS {c.ROLE},
               CAST(SUM(GREATEST(0, p.hi - p.lo)) AS BIGINT) AS ns,
               CAST(SUM(p.hi - p.lo) FILTER (WHERE {first}) AS BIGINT) AS first_ns,
               MIN(p.lo) FILTER (WHERE {first}) AS first_start_ns
        FROM ({span_pieces_sql(src)}) p {instances}
        WHERE p.{c.STAGE} IS NOT NULL
        GROUP BY p.{c.REQUEST_ID}, p.{c.STAGE}, {role}
    )"""
    src.execute(f"CREATE OR REPLACE TEMP TABLE {table} AS {REQUEST_STAGE_NS.rows_sql(summed)}")


_ROLE_CASES = 16  # instances up to which a span's role is a CASE over its instance id rather than a join


def _role_sql(src: Source, instance: str) -> tuple[str, str]:
    """The role of the instance ``instance`` (an expression) as an expression, -1 for an instance missing from the
    instances table or without a role, and the join clause it needs (alias ``i``; empty for a CASE): a run's few
    instances are spelt out in a CASE, so that no span row crosses a join."""
    c = col
    rows = src.cached("instance_roles", lambda: src.df(f"SELECT {c.INSTANCE_ID}, {c.ROLE} FROM instances"))
    ids = rows[c.INSTANCE_ID].dropna().astype("int64").tolist()
    if len(rows) > _ROLE_CASES or len(ids) != len(rows) or len(set(ids)) != len(ids):
        return f"COALESCE(i.{c.ROLE}, -1)", f"LEFT JOIN instances i ON i.{c.INSTANCE_ID} = {instance}"
    if not ids:
        return "-1", ""
    roles = [-1 if pd.isna(r) else int(r) for r in rows[c.ROLE]]
    return "CASE " + instance + "".join(f" WHEN {i} THEN {r}" for i, r in zip(ids, roles)) + " ELSE -1 END", ""


def _stage_totals_sql(src: Source, rows: str, groups: str | None) -> str:
    """:attr:`REQUEST_STAGE_NS`'s summary: per group of requests (``groups``: (request_id, grp) pairs, or None: one
    group, grp 0) and stage, ``ns`` and ``first_ns`` summed (a request without a token-0 part adds 0), from
    relation ``rows`` of the fact's rows."""
    c = col
    grp, join = ("g.grp", f" JOIN {groups} g ON g.{c.REQUEST_ID} = w.{c.REQUEST_ID}") if groups else ("0", "")
    # (a constant is no group key: GROUP BY 0 is a position)
    return f"""
        SELECT {grp} AS grp, w.{c.STAGE}, SUM(w.ns) AS ns, SUM(COALESCE(w.first_ns, 0)) AS first_ns
        FROM {rows} w{join} GROUP BY {"g.grp, " if groups else ""}w.{c.STAGE}
    """


_PIECE_SUMS = "stage_piece_sums"  # temp table of one pass over the spans (dropped after use)


def _stage_totals_along(src: Source, groups: str | None, keys: str, table: str, rows: str) -> None:
    """:func:`_stage_totals_sql`'s sums as temp table ``table`` and the :data:`TOKEN_STAGE_NS` rows of the tokens in
    relation ``keys`` as temp table ``rows``, in one pass over the spans and without a row per request: the spans'
    clipped time summed per group, stage and whether it counts in token 0 (the per-request sums summed again are
    these, the same integers), and, for the pieces counting in a token of ``keys`` (joined once more:
    :func:`analyzers.attribution.span_pieces_sql`'s ``mark``), per token and stage. The per-request groups of a
    large run cost more than the join itself; the groups of requests are joined to the spans instead (one row per
    request, small)."""
    c = col
    grp, join = ("g.grp", f" JOIN {groups} g ON g.{c.REQUEST_ID} = p.{c.REQUEST_ID}") if groups else ("0", "")
    key = token_key_sql(src, "p")  # a marked piece's token as one group key when it fits a BIGINT
    marks = ([f"CASE WHEN p.marked THEN {key} END AS token_key"] if key is not None else
             [f"CASE WHEN p.marked THEN p.{c.REQUEST_ID} END AS {c.REQUEST_ID}",
              f"CASE WHEN p.marked THEN p.{c.TOKEN_INDEX} END AS {c.TOKEN_INDEX}"])
    first = f"p.{c.TOKEN_INDEX} = 0"
    by = [f"p.{c.STAGE}", first] + [m.rsplit(" AS ", 1)[0] for m in marks]
    src.execute(f"""
        CREATE OR REPLACE TEMP TABLE {_PIECE_SUMS} AS
        SELECT {grp} AS grp, p.{c.STAGE}, {first} AS first, {", ".join(marks)}, SUM(GREATEST(0, p.hi - p.lo)) AS ns
        FROM ({span_pieces_sql(src, mark=keys)}) p{join}
        WHERE p.{c.STAGE} IS NOT NULL
        GROUP BY {"g.grp, " if groups else ""}{", ".join(by)}
    """)
    unmarked = marks[0].rsplit(" AS ", 1)[1] + " IS NULL"
    src.execute(f"""
        CREATE OR REPLACE TEMP TABLE {table} AS
        SELECT grp, {c.STAGE}, SUM(ns) AS ns, COALESCE(SUM(CASE WHEN first THEN ns END), 0) AS first_ns
        FROM {_PIECE_SUMS} WHERE {unmarked} GROUP BY grp, {c.STAGE}
    """)
    src.execute(f"CREATE OR REPLACE TEMP TABLE {rows} AS {TOKEN_STAGE_NS.rows_sql(f'({_keyed_rows_sql(src, keys)})')}")
    src.execute(f"DROP TABLE IF EXISTS {_PIECE_SUMS}")


def _keyed_rows_sql(src: Source, keys: str) -> str:
    """The :data:`TOKEN_STAGE_NS` rows of the tokens in relation ``keys``, from :data:`_PIECE_SUMS`."""
    c = col
    sums = ", ".join(f"SUM(CASE WHEN s.{c.STAGE} = {int(st)} THEN s.ns ELSE 0 END) AS {stage_column(st)}"
                     for st in Stage)
    filled = ", ".join(f"COALESCE(w.{stage_column(st)}, 0) AS {stage_column(st)}" for st in Stage)
    key = token_key_sql(src, "t")
    by = ["token_key"] if key is not None else [c.REQUEST_ID, c.TOKEN_INDEX]
    on = (f"w.token_key = {key}" if key is not None else
          f"w.{c.REQUEST_ID} = t.{c.REQUEST_ID} AND w.{c.TOKEN_INDEX} = t.{c.TOKEN_INDEX}")
    return f"""
        SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{LATENCY}, {filled}
        FROM {token_times(src)} t
        JOIN {keys} k ON k.{c.REQUEST_ID} = t.{c.REQUEST_ID} AND k.{c.TOKEN_INDEX} = t.{c.TOKEN_INDEX}
        LEFT JOIN (
            SELECT {", ".join(f"s.{b}" for b in by)}, {sums}
            FROM {_PIECE_SUMS} s WHERE s.{by[0]} IS NOT NULL GROUP BY {", ".join(f"s.{b}" for b in by)}
        ) w ON {on}
    """


REQUEST_STAGE_NS = facts.Fact(
    "request_stage_ns", "One row per (request, stage, role of the recording instance) with spans that count in a "
                        "token interval of the request: the time they count there, clipped as the breakdown clips "
                        "them (summed over its tokens, so a stage's time per request is the breakdown's), and that "
                        "of token 0. What the breakdown, load, queue, cache, critical-path, slowest-request and "
                        "diff analyses sum per request.",
    (SPANS.column(col.REQUEST_ID), SPANS.column(col.STAGE),
     INSTANCES.column(col.ROLE),  # null for an instance missing from the instances table
     facts.i64("ns", "Their time inside the request's token intervals (each span clipped to the interval of the "
                     "token it counts in), summed; ns."),
     facts.i64("first_ns", "Their time counted in token 0's interval (TTFT); null without any; ns."),
     facts.i64("first_start_ns", "The earliest moment of that time; ns, reference clock.")),
    build=_build_request_stage_ns, summary=_stage_totals_sql,
    summary_along=(TOKEN_STAGE_NS, _stage_totals_along))


def request_stage_ns(src: Source) -> str:
    """Relation of :data:`REQUEST_STAGE_NS`."""
    return facts.relation(src, REQUEST_STAGE_NS)


_GROUPS = "bd_groups"  # temp table of a breakdown's groups: one row per request, (request_id, grp)


def _tokens_sql(src: Source, groups: str | None) -> str:
    """SQL of every delivered token: request, index, latency (lat), group (grp: 0 without ``groups``), first?"""
    c = col
    grp = "g.grp" if groups else "0"
    columns = f"t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{LATENCY} AS lat, {grp} AS grp, t.{c.TOKEN_INDEX} = 0 AS first"
    tt = token_times(src)
    if groups is None:
        return f"SELECT {columns} FROM {tt} t"
    return f"SELECT {columns} FROM {tt} t JOIN {groups} g ON g.{c.REQUEST_ID} = t.{c.REQUEST_ID}"


def token_stage_ns(src: Source) -> str:
    """Relation of :data:`TOKEN_STAGE_NS`."""
    return facts.relation(src, TOKEN_STAGE_NS)


def _tail_cuts(src: Source, tokens: str, tail_fraction: float) -> None:
    """Temp table ``bd_cut``: per (group, kind), its tokens (n) and their summed latency (lat), and the last token
    of its tail: the k-th slowest of its n tokens, k = ceil(tail_fraction * n) (at least 1), ties ordered by
    request id then token index.

    A token is in the tail when it ranks at or before that one (:data:`_IN_TAIL`): no table of tail tokens is
    joined to the spans. Candidates first (>= a quantile that keeps at least twice the tail), then the exact
    rank: ranking only the candidates avoids sorting every token. ``tokens`` is read twice rather than named once
    as a common table expression, which DuckDB would write out whole (every token) before either read."""
    c = col
    q = max(0.0, 1.0 - 2.0 * tail_fraction)
    src.execute(f"""
        CREATE OR REPLACE TEMP TABLE bd_cut AS
        WITH q AS (SELECT grp, first, COUNT(*) AS n, SUM(lat)::DOUBLE AS lat, quantile_disc(lat, {q}) AS cut
                   FROM ({tokens}) tok GROUP BY grp, first),
        ranked AS (
            SELECT b.grp, b.first, b.lat, b.{c.REQUEST_ID}, b.{c.TOKEN_INDEX}, q.n,
                   ROW_NUMBER() OVER (PARTITION BY b.grp, b.first
                                      ORDER BY b.lat DESC, b.{c.REQUEST_ID}, b.{c.TOKEN_INDEX}) AS rank
            FROM ({tokens}) b JOIN q ON b.grp IS NOT DISTINCT FROM q.grp AND b.first = q.first
            WHERE b.lat >= q.cut
        )
        SELECT q.grp, q.first, q.n, q.lat, r.lat AS cut_lat, r.{c.REQUEST_ID} AS cut_request,
               r.{c.TOKEN_INDEX} AS cut_index
        FROM q JOIN ranked r ON r.grp IS NOT DISTINCT FROM q.grp AND r.first = q.first
        WHERE r.rank = GREATEST(1, CEIL(q.n * {tail_fraction}))
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

    Columns: request_id, token_index, stage_id, ns: each span's time that counts in that token's interval
    (:func:`analyzers.attribution.span_pieces_sql`: clipped to the own interval of the token it works toward; in
    one process that is the whole span, across processes the engine runs ahead of the stream).
    """
    def build() -> str:
        c = col
        src.execute(f"""
            CREATE OR REPLACE TEMP TABLE token_spans AS
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, {c.STAGE}, GREATEST(0, hi - lo) AS ns
            FROM ({span_pieces_sql(src)}) p
        """)
        return "token_spans"
    return src.cached("token_spans", build)


def _sums(src: Source, tokens: str, groups: str | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (group, kind): tokens, summed latency and tail latency (``tot``); per (group, kind, stage): the stage time
    of all the tokens and of the tail tokens (``per``).

    All tokens' stage time is the requests' summed per group (:data:`REQUEST_STAGE_NS`'s summary: token 0's part
    is TTFT's, the rest ITL's, the same clipped time the per-token sums hold); the tail tokens' is read from their
    rows of :data:`TOKEN_STAGE_NS` only. Both through :func:`analyzers.facts.summary_and_rows`: a run without saved
    facts builds them in one pass over the spans (the sums per group and the tail tokens' rows, neither a row per
    request nor one per token of the run). ``groups``: the requests' groups (:data:`_GROUPS`), None for one."""
    c = col
    every = src.df("SELECT grp, first, n, lat FROM bd_cut")
    lowest = src.scalar("SELECT MIN(cut_lat) FROM bd_cut")
    candidates = f"SELECT * FROM ({tokens}) c WHERE c.lat >= {int(lowest) if lowest is not None else 0}"
    src.execute(f"CREATE OR REPLACE TEMP TABLE bd_tail AS SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, grp, first, lat "
                f"FROM ({_with_tail(candidates)}) k WHERE k.tail")
    summed, tail_rows = facts.summary_and_rows(src, REQUEST_STAGE_NS, groups, TOKEN_STAGE_NS, "bd_tail")
    known = ", ".join(str(int(st)) for st in Stage)
    totals = src.df(f"""
        SELECT w.grp, w.{c.STAGE} AS stage, w.first_ns::DOUBLE AS ttft_ns, (w.ns - w.first_ns)::DOUBLE AS itl_ns
        FROM {summed} w WHERE w.{c.STAGE} IN ({known})
    """)
    stage_sums = "".join(f", SUM(w.{stage_column(st)})::DOUBLE AS ns_{i}" for i, st in enumerate(Stage))
    tail = src.df(f"""
        SELECT k.grp, k.first, SUM(k.lat)::DOUBLE AS tail_lat{stage_sums}
        FROM bd_tail k JOIN ({tail_rows}) w
             ON w.{c.REQUEST_ID} = k.{c.REQUEST_ID} AND w.{c.TOKEN_INDEX} = k.{c.TOKEN_INDEX}
        GROUP BY k.grp, k.first
    """)
    src.execute("DROP TABLE IF EXISTS bd_tail")
    key = ["grp", "first"]
    merged = every.merge(tail, on=key, how="left")
    tot = merged[key + ["n", "lat"]].assign(tail_lat=merged["tail_lat"].fillna(0.0),
                                            kind=np.where(merged["first"].astype(bool), "ttft", "itl"))
    long_totals = pd.concat([totals.assign(first=True, ns=totals["ttft_ns"]),
                             totals.assign(first=False, ns=totals["itl_ns"])])[["grp", "first", "stage", "ns"]]
    tail_rows = pd.DataFrame([{"grp": r["grp"], "first": bool(r["first"]), "stage": int(st),
                               "tail_ns": 0.0 if pd.isna(r[f"ns_{i}"]) else r[f"ns_{i}"]}
                              for r in tail.to_dict("records") for i, st in enumerate(Stage)],
                             columns=["grp", "first", "stage", "tail_ns"])
    per = long_totals.astype({"first": bool, "stage": "int64"}).merge(
        tail_rows, on=["grp", "first", "stage"], how="outer")
    per = per.fillna({"ns": 0.0, "tail_ns": 0.0})
    return tot, per.assign(kind=np.where(per["first"].astype(bool), "ttft", "itl"))


def breakdown(src: Source, *, by: str | None = None, window_s: float | None = None,
              tail_fraction: float = TAIL_FRACTION) -> pd.DataFrame:
    """One row per stage (plus ``unattributed``) and group: mean ms and share of TTFT and ITL, mean and tail.

    Columns: [group column], stage, ttft_mean_ms, ttft_share, ttft_tail_share,
    itl_mean_ms, itl_share, itl_tail_share. Shares are NaN for a kind with no
    tokens. ``by`` / ``window_s`` as :func:`analyzers.latency.latency`.

    Computed once per source and arguments (the KV-transfer share of :mod:`analyzers.pd_ratio` is read from the
    same breakdown the report shows); each call returns its own copy.
    """
    if not 0 < tail_fraction <= 1:
        raise ValueError(f"tail_fraction must be in (0, 1], got {tail_fraction!r}")
    key = f"stage_breakdown:{by!r}:{window_s!r}:{tail_fraction!r}"
    return src.cached(key, lambda: _breakdown(src, by, window_s, tail_fraction)).copy()


def _breakdown(src: Source, by: str | None, window_s: float | None, tail_fraction: float) -> pd.DataFrame:
    gcol = group_column(by, window_s)
    start = None
    if window_s is not None:
        b = run_bounds(src)
        start = b[0] if b else 0
    g = group_sql(by, window_s, alias="f", start_ns=start)
    groups = None
    if g != "0":  # each request's group once
        groups = _GROUPS
        src.execute(f"CREATE OR REPLACE TEMP TABLE {groups} AS "
                    f"SELECT f.{col.REQUEST_ID}, {g} AS grp FROM {request_table(src)} f")
    tokens = _tokens_sql(src, groups)
    _tail_cuts(src, tokens, tail_fraction)
    tot, per = _sums(src, tokens, groups)
    src.execute(f"DROP TABLE IF EXISTS bd_cut; DROP TABLE IF EXISTS {_GROUPS}")
    groups = sorted(tot["grp"].unique().tolist()) if gcol is not None else [0]
    result = _assemble(groups, tot, per)
    if gcol is not None:
        result.insert(0, gcol, np.repeat(pd.Series(groups).to_numpy(), len(STAGE_LABELS)))
    return result


def _assemble(groups: list, tot: pd.DataFrame, per: pd.DataFrame) -> pd.DataFrame:
    """The per-stage rows of every group (``len(STAGE_LABELS)`` rows each, in ``groups`` order) from the token
    totals and per-stage sums, all groups at once (a run with 10 000 tenants is 10 000 groups)."""
    num_g, num_s = len(groups), len(STAGE_LABELS)
    index = {grp: i for i, grp in enumerate(groups)}
    result = pd.DataFrame({"stage": np.tile(np.array(STAGE_LABELS, dtype=object), num_g)})
    for kind in _KINDS:
        t = tot[tot["kind"] == kind]
        rows_t = np.array([index.get(g, -1) for g in t["grp"]], dtype=np.int64)
        keep_t = rows_t >= 0
        n, lat, tail_lat = np.zeros(num_g), np.zeros(num_g), np.zeros(num_g)
        n[rows_t[keep_t]] = t["n"].to_numpy(float)[keep_t]
        lat[rows_t[keep_t]] = t["lat"].to_numpy(float)[keep_t]
        tail_lat[rows_t[keep_t]] = np.nan_to_num(t["tail_lat"].to_numpy(float)[keep_t])
        p = per[per["kind"] == kind]
        rows_p = np.array([index.get(g, -1) for g in p["grp"]], dtype=np.int64)
        keep_p = rows_p >= 0
        at = rows_p[keep_p] * num_s + ROW_OF_STAGE[p["stage"].to_numpy(np.int64)[keep_p]]
        ns = np.bincount(at, weights=p["ns"].to_numpy(float)[keep_p], minlength=num_g * num_s).reshape(num_g, num_s)
        tail = np.bincount(at, weights=p["tail_ns"].to_numpy(float)[keep_p],
                           minlength=num_g * num_s).reshape(num_g, num_s)
        ns[:, -1] = lat - ns[:, :-1].sum(axis=1)
        tail[:, -1] = tail_lat - tail[:, :-1].sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            result[f"{kind}_mean_ms"] = np.where(n[:, None] > 0, ns / n[:, None] / 1e6, np.nan).ravel()
            result[f"{kind}_share"] = np.where(lat[:, None] > 0, ns / lat[:, None], np.nan).ravel()
            result[f"{kind}_tail_share"] = np.where(tail_lat[:, None] > 0, tail / tail_lat[:, None], np.nan).ravel()
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
    """Wide table: one row per token, its interval and latency and one column of ns per stage label + unattributed.

    For small in-memory tables (it is one row per token).
    """
    src = Source.of_tables(spans=spans, requests=requests, tokens=tokens, instances=instances)
    c = col
    labels = ", ".join(f"w.{stage_column(st)} AS \"{st.label}\"" for st in Stage)
    out = src.df(f"""
        SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{TOKEN_START}, t.{TOKEN_END}, t.{LATENCY}, {labels}
        FROM {token_times(src)} t JOIN {token_stage_ns(src)} w USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
        ORDER BY t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}
    """)
    names = [st.label for st in Stage]
    out[names] = out[names].astype("int64")
    out[UNATTRIBUTED_LABEL] = out[LATENCY] - out[names].sum(axis=1)
    return out


def stage_breakdown(spans: pa.Table, requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """:func:`breakdown` (no grouping) over in-memory Arrow tables."""
    return breakdown(Source.of_tables(spans=spans, requests=requests, tokens=tokens, instances=instances))


def unattributed_share(spans: pa.Table, requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> float:
    """:func:`unattributed` over in-memory Arrow tables."""
    value = unattributed(Source.of_tables(spans=spans, requests=requests, tokens=tokens, instances=instances))
    return value if math.isfinite(value) else 0.0
