"""How spans are attributed to tokens, and the attribution invariant's gauges: unattributed time (signed) and
overlap, per kind of token.

A span counts toward the token it works toward (:func:`span_pieces_sql`): the token index its process gave it,
but never one before the first token that process emitted for the request (a disaggregated decode worker tags its
queue and preemption spans with token 0, which the prefill worker produced: they work toward the decode
worker's first token). The span is clipped to that token's own interval (:mod:`analyzers.timing`: the engine
runs ahead of the stream, and the part of a span hidden behind the previous token's delivery is not this token's
latency), and its time counts in that token's interval, or in token 0's when the token was delivered by the first
visible content (held back with it): token 0's stages tile ``[arrival, first visible content]``.

For every delivered token:

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
from analyzers.timing import COUNTED_IN, LATENCY, OWN_END, OWN_START, token_times
from tokentrace.schema import TOKENS, col

__all__ = ["TOKEN_COVERAGE", "span_pieces_sql", "token_key_sql", "KINDS", "token_coverage", "attribution", "unattributed_share",
           "overlap_share"]

KINDS: tuple[str, ...] = ("ttft", "itl", "all")
COLUMNS = ["kind", "num_tokens", "latency_ms", "stage_ms", "covered_ms", "unattributed_share", "overlap_share",
           "uncovered_share"]


def token_coverage(src: Source) -> str:
    """Relation of :data:`TOKEN_COVERAGE`: one row per delivered token: request_id, token_index, latency_ns,
    stage_ns (sum of clipped spans), covered_ns (union of clipped spans)."""
    return facts.relation(src, TOKEN_COVERAGE)


def span_pieces_sql(src: Source, only: str | None = None, *, mark: str | None = None) -> str:
    """SELECT of every server span tagged with a token, with the token it counts in (module doc): request_id,
    token_index (the token whose interval gets its time), stage_id, instance_id, start_ns, end_ns, and lo, hi:
    the span clipped to the own interval of the token it works toward (``hi <= lo``: none of it is inside).

    ``only``: a relation of distinct (request_id, token_index) pairs: then only the spans that count in those
    tokens (the join to the token intervals keeps those tokens' rows only, so fewer spans cross it).
    ``mark``: such a relation too, but every span is kept, with a column ``marked`` false, and the spans that count
    in one of those tokens come once more, with ``marked`` true: the token rows of those pairs are joined twice
    (known from the token's row, so no span crosses a second join, and a sum over the unmarked rows is every span's
    without a second grouping)."""
    c = col
    tt = token_times(src)
    if only is not None:
        tt = (f"(SELECT t.* FROM {tt} t JOIN {only} k "
              f"ON k.{c.REQUEST_ID} = t.{c.REQUEST_ID} AND k.{c.TOKEN_INDEX} = t.{COUNTED_IN})")
    marked = ""
    if mark is not None:
        tt = (f"(SELECT t.*, false AS marked FROM {tt} t UNION ALL "
              f"SELECT t.*, true AS marked FROM {tt} t JOIN {mark} k "
              f"ON k.{c.REQUEST_ID} = t.{c.REQUEST_ID} AND k.{c.TOKEN_INDEX} = t.{COUNTED_IN})")
        marked = ", t.marked"
    toward, floors = f"s.{c.TOKEN_INDEX}", ""
    if _num_emitting_instances(src) > 1:  # a process's spans work toward a token it emits, never an earlier one
        toward = f"GREATEST(s.{c.TOKEN_INDEX}, COALESCE(e.first_emitted, 0))"
        floors = f"""LEFT JOIN (
                SELECT {c.REQUEST_ID}, {c.INSTANCE_ID}, MIN({c.TOKEN_INDEX}) AS first_emitted FROM srv_tokens
                WHERE {c.EMIT_NS} IS NOT NULL GROUP BY {c.REQUEST_ID}, {c.INSTANCE_ID}
            ) e ON e.{c.REQUEST_ID} = s.{c.REQUEST_ID} AND e.{c.INSTANCE_ID} = s.{c.INSTANCE_ID}"""
    on = f"t.{c.REQUEST_ID} = s.{c.REQUEST_ID} AND s.{c.TOKEN_INDEX} >= 0 AND t.{c.TOKEN_INDEX} = {toward}"
    key = _token_key(src)
    if key is not None:  # one BIGINT per token instead of two columns: a cheaper hash join
        first, width, last = key
        tt = f"(SELECT t.*, {_key_sql('t', first, width)} AS token_key FROM {tt} t)"
        # a span outside the tokens' bounds matches no token: it gets no key (and no product that could overflow)
        on = (f"t.token_key = CASE WHEN s.{c.TOKEN_INDEX} >= 0 AND s.{c.REQUEST_ID} BETWEEN ({first}) AND ({last}) "
              f"AND {toward} < {width} THEN {_key_sql('s', first, width, toward)} END")
    return f"""
        SELECT s.{c.REQUEST_ID}, t.{COUNTED_IN} AS {c.TOKEN_INDEX}, s.{c.STAGE}, s.{c.INSTANCE_ID}, s.{c.START_NS},
               s.{c.END_NS}, GREATEST(s.{c.START_NS}, t.{OWN_START}) AS lo, LEAST(s.{c.END_NS}, t.{OWN_END}) AS hi{marked}
        FROM srv_spans s {floors}
        JOIN {tt} t ON {on}
    """


_INT64_MAX = 2**63 - 1


def _token_key(src: Source) -> tuple[int, int, int] | None:
    """(first request id, width, last request id) of the delivered tokens, for one BIGINT key per token:
    (request_id - first) * width + token_index, width above every token index; None when the tokens have a
    negative index or the keys would not fit in a BIGINT (then the join keeps its two columns). Once per source."""
    def bounds() -> tuple[int, int, int] | None:
        c = col
        row = src.fetchone(f"SELECT MIN({c.REQUEST_ID}), MAX({c.REQUEST_ID}), MIN({c.TOKEN_INDEX}), "
                           f"MAX({c.TOKEN_INDEX}) FROM {token_times(src)}")
        if row is None or any(v is None for v in row) or int(row[2]) < 0:
            return None
        first, last, width = int(row[0]), int(row[1]), int(row[3]) + 1
        return (first, width, last) if (last - first + 1) * width <= _INT64_MAX else None
    return src.cached("token_key", bounds)


def token_key_sql(src: Source, alias: str) -> str | None:
    """SQL of one BIGINT per token of row ``alias`` (its request_id and token_index those of a delivered token), the
    same as the one :func:`span_pieces_sql` joins by; None when the tokens' bounds do not keep it in a BIGINT."""
    key = _token_key(src)
    return None if key is None else _key_sql(alias, key[0], key[1])


def _key_sql(alias: str, first: int, width: int, index: str | None = None) -> str:
    """The token key of :func:`_token_key` of row ``alias`` (``index``: its token index expression)."""
    c = col
    return f"({alias}.{c.REQUEST_ID} - ({first})) * {width} + {index or f'{alias}.{c.TOKEN_INDEX}'}"


def _num_emitting_instances(src: Source) -> int:
    """How many server processes emitted tokens (1 in a colocated run), counted once per source."""
    return int(src.cached("num_emitting_instances", lambda: src.scalar(
        f"SELECT COUNT(DISTINCT {col.INSTANCE_ID}) FROM srv_tokens WHERE {col.EMIT_NS} IS NOT NULL") or 0))


def _token_coverage_sql(src: Source) -> str:
    c = col
    tt = token_times(src)
    return f"""
        WITH pieces AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, lo, hi,
                   MAX(hi) OVER (PARTITION BY {c.REQUEST_ID}, {c.TOKEN_INDEX} ORDER BY lo, hi
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach
            FROM ({span_pieces_sql(src)}) p WHERE hi > lo
        ), per_token AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, SUM(hi - lo) AS stage_ns,
                   SUM(GREATEST(0, hi - GREATEST(lo, COALESCE(reach, lo)))) AS covered_ns
            FROM pieces GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        )
        SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{LATENCY},
               COALESCE(p.stage_ns, 0) AS stage_ns, COALESCE(p.covered_ns, 0) AS covered_ns
        FROM {tt} t LEFT JOIN per_token p USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
    """


TOKEN_COVERAGE = facts.Fact(
    "token_coverage", "One row per delivered token: its latency, the summed time of its spans clipped to its "
                      "interval, and the length of their union (module doc).",
    (TOKENS.column(col.REQUEST_ID), TOKENS.column(col.TOKEN_INDEX),
     facts.i64(LATENCY, "The token's latency (TTFT for token 0, else ITL); ns."),
     facts.i64("stage_ns", "The time of the spans that count in its interval, clipped (module doc), summed; ns."),
     facts.i64("covered_ns", "Length of the union of those clipped spans; ns.")),
    select=_token_coverage_sql)


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
