"""The rows every speculative-decoding figure is computed from (:mod:`analyzers.speculative`).

SQL fragments over ``spec_steps``, the shared token facts (:mod:`analyzers.timing`) and ``steps``, in
standard SQL (no engine-specific function): :func:`spec_rows_sql` (one row per request per speculative
step, with the tokens it emitted and its step time) and :func:`token_rows_sql` (one row per delivered
decode token, speculative or plain). The definitions are in :mod:`analyzers.speculative`'s documentation.
"""

from __future__ import annotations

import math

import pandas as pd

from analyzers import facts
from analyzers.source import Source
from analyzers.timing import LATENCY, token_steps, token_times
from tokentrace.schema import SPEC_STEPS, STEPS, TOKENS, col

__all__ = ["SPECULATIVE", "PLAIN", "bin_sql", "bin_lo", "spec_rows_sql", "token_rows_sql", "has_speculation",
           "empty_frame", "ratio"]

SPECULATIVE = "speculative"
PLAIN = "plain"
_MAX_BIN_POWER = 20  # batch-size bins up to 2**20 sequences


def bin_sql(expr: str) -> str:
    """The upper end of ``expr``'s power-of-two bin: 1, 2, 4, 8, ... (null for a null or a huge size)."""
    cases = " ".join(f"WHEN {expr} <= {2 ** p} THEN {2 ** p}" for p in range(_MAX_BIN_POWER + 1))
    return f"CASE {cases} END"


def _spec_rows_ctes(tt: str) -> str:
    """CTEs ``spec`` (one row per spec_steps row with k, a, its token range and phase times) and ``spec_rows``
    (``spec`` with ``emitted`` and ``step_ns``); ``tt`` is the token facts table."""
    c = col
    return f"""
        spec AS (
            SELECT {c.INSTANCE_ID}, {c.REQUEST_ID}, {c.STEP}, {c.DRAFT_SOURCE}, {c.NUM_PROPOSED} AS k,
                   {c.NUM_ACCEPTED} AS a, {c.FIRST_TOKEN_INDEX} AS lo,
                   {c.FIRST_TOKEN_INDEX} + {c.NUM_ACCEPTED} AS hi,
                   {c.DRAFT_END_NS} - {c.DRAFT_START_NS} AS draft_ns,
                   {c.VERIFY_END_NS} - {c.VERIFY_START_NS} AS verify_ns,
                   {c.VERIFY_END_NS} - {c.DRAFT_START_NS} AS phases_ns, {c.BATCH_SIZE} AS batch
            FROM {SPEC_STEPS.name}
        ), emitted_tokens AS (
            SELECT sp.{c.INSTANCE_ID}, sp.{c.REQUEST_ID}, sp.{c.STEP}, COUNT(*) AS n
            FROM spec sp JOIN {tt} t ON t.{c.REQUEST_ID} = sp.{c.REQUEST_ID}
                 AND t.{c.TOKEN_INDEX} >= sp.lo AND t.{c.TOKEN_INDEX} <= sp.hi
            GROUP BY sp.{c.INSTANCE_ID}, sp.{c.REQUEST_ID}, sp.{c.STEP}
        ), requests_with_tokens AS (
            SELECT DISTINCT {c.REQUEST_ID} FROM {tt}
        ), spec_rows AS (
            SELECT sp.*,
                   CASE WHEN w.{c.REQUEST_ID} IS NULL THEN sp.a + 1 ELSE COALESCE(e.n, 0) END AS emitted,
                   COALESCE(st.{c.END_NS} - st.{c.START_NS}, sp.phases_ns) AS step_ns
            FROM spec sp
            LEFT JOIN emitted_tokens e ON e.{c.INSTANCE_ID} = sp.{c.INSTANCE_ID}
                 AND e.{c.REQUEST_ID} = sp.{c.REQUEST_ID} AND e.{c.STEP} = sp.{c.STEP}
            LEFT JOIN requests_with_tokens w ON w.{c.REQUEST_ID} = sp.{c.REQUEST_ID}
            LEFT JOIN {STEPS.name} st ON st.{c.INSTANCE_ID} = sp.{c.INSTANCE_ID} AND st.{c.STEP} = sp.{c.STEP}
        )"""


def spec_step_rows_sql(src: Source) -> str:
    """SELECT of the rows of :func:`spec_rows_sql`'s ``spec_rows``, from the run's tables (the rows of
    :data:`SPEC_STEP_ROWS`)."""
    return f"WITH {_spec_rows_ctes(token_times(src))} SELECT * FROM spec_rows"


def spec_rows_sql(src: Source) -> str:
    """CTE ``spec_rows``: one row per spec_steps row with k, a, its token range ``lo``..``hi``, ``draft_ns``,
    ``verify_ns``, ``phases_ns``, ``batch``, ``emitted`` and ``step_ns``: the derived fact :data:`SPEC_STEP_ROWS`
    (every speculative figure reads it; the join with the token facts is the costly part)."""
    return f"spec_rows AS (SELECT * FROM {facts.relation(src, SPEC_STEP_ROWS)})"


def decode_tokens_sql(src: Source) -> str:
    """SELECT of the rows of :func:`token_rows_sql`'s ``decode_tokens``, from the run's tables (the rows of
    :data:`SPEC_DECODE_TOKENS`; none for a run that never speculated, where nothing reads them)."""
    return f"WITH {_token_rows_ctes(src)} SELECT * FROM decode_tokens" + ("" if has_speculation(src) else " LIMIT 0")


def token_rows_sql(src: Source) -> str:
    """CTEs of :func:`spec_rows_sql` plus ``decode_tokens``: one row per delivered decode token with its
    ``mode``, ``carrier`` (1 on the token that carries its step), ``batch``, ``step_ns`` (on carriers),
    ``step_known`` (1 when its step's time is known) and ``beside_spec`` (1 on a plain token whose engine step
    had speculating requests: a mixed batch). ``decode_tokens`` is the derived fact :data:`SPEC_DECODE_TOKENS`."""
    return spec_rows_sql(src) + f", decode_tokens AS (SELECT * FROM {facts.relation(src, SPEC_DECODE_TOKENS)})"


def _token_rows_ctes(src: Source) -> str:
    """:func:`token_rows_sql`'s CTEs, from the run's tables."""
    c = col
    tt, ts = token_times(src), token_steps(src)
    plain_step_ns = f"pst.{c.END_NS} - pst.{c.START_NS}"
    return spec_rows_sql(src) + f""", speculating_steps AS (
            SELECT DISTINCT {c.INSTANCE_ID}, {c.STEP} FROM spec_rows
        ), decode_tokens AS (
            SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{LATENCY} AS lat,
                   CASE WHEN sr.lo IS NULL THEN '{PLAIN}' ELSE '{SPECULATIVE}' END AS mode,
                   CASE WHEN sr.lo IS NULL OR t.{c.TOKEN_INDEX} = sr.lo THEN 1 ELSE 0 END AS carrier,
                   CASE WHEN sr.lo IS NULL THEN pst.{c.NUM_SEQS} ELSE sr.batch END AS batch,
                   CASE WHEN sr.lo IS NULL THEN {plain_step_ns}
                        WHEN t.{c.TOKEN_INDEX} = sr.lo THEN sr.step_ns END AS step_ns,
                   CASE WHEN (sr.lo IS NULL AND pst.{c.END_NS} IS NOT NULL)
                          OR (sr.lo IS NOT NULL AND sr.step_ns IS NOT NULL) THEN 1 ELSE 0 END AS step_known,
                   CASE WHEN sr.lo IS NULL AND ss.{c.STEP} IS NOT NULL THEN 1 ELSE 0 END AS beside_spec
            FROM {tt} t
            LEFT JOIN spec_rows sr ON sr.{c.REQUEST_ID} = t.{c.REQUEST_ID}
                 AND t.{c.TOKEN_INDEX} >= sr.lo AND t.{c.TOKEN_INDEX} <= sr.hi
            LEFT JOIN {ts} x ON sr.lo IS NULL AND x.{c.REQUEST_ID} = t.{c.REQUEST_ID}
                 AND x.{c.TOKEN_INDEX} = t.{c.TOKEN_INDEX}
            LEFT JOIN {STEPS.name} pst ON pst.{c.INSTANCE_ID} = x.{c.INSTANCE_ID} AND pst.{c.STEP} = x.{c.STEP}
            LEFT JOIN speculating_steps ss ON ss.{c.INSTANCE_ID} = x.{c.INSTANCE_ID} AND ss.{c.STEP} = x.{c.STEP}
            WHERE t.{c.TOKEN_INDEX} > 0
        )"""


def has_speculation(src: Source) -> bool:
    """True when the run has a ``spec_steps`` row (counted once per source)."""
    return bool(src.cached("spec_steps_count", lambda: int(src.scalar(f"SELECT COUNT(*) FROM {SPEC_STEPS.name}")
                                                            or 0)))


def empty_frame(columns: dict[str, str]) -> pd.DataFrame:
    """A frame with no rows and the given columns and dtypes (what a run without speculation gets)."""
    return pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in columns.items()})


def ratio(num: float, den: float) -> float:
    """``num / den``; NaN (not measured) when either is missing or the denominator is 0."""
    return float(num) / float(den) if den and not pd.isna(den) and not pd.isna(num) else math.nan


def bin_lo(hi: int) -> int:
    """The lower end of the power-of-two batch-size bin whose upper end is ``hi``: 1, 2, 3, 5, 9, ..."""
    return 1 if hi <= 1 else hi // 2 + 1


SPEC_STEP_ROWS = facts.Fact(
    "spec_step_rows", "One row per spec_steps row with its proposals, accepted prefix, token range, phase times, "
                      "the tokens it emitted and its step time (analyzers.speculative).",
    (SPEC_STEPS.column(col.INSTANCE_ID), SPEC_STEPS.column(col.REQUEST_ID), SPEC_STEPS.column(col.STEP),
     SPEC_STEPS.column(col.DRAFT_SOURCE), facts.i64("k", "Draft tokens proposed."),
     facts.i64("a", "Proposed tokens accepted."), facts.i32("lo", "First token index the step produced."),
     facts.i64("hi", "Last token index it produced (lo + a)."), facts.i64("draft_ns", "Draft phase; ns."),
     facts.i64("verify_ns", "Verify phase; ns."), facts.i64("phases_ns", "Draft start to verify end; ns."),
     facts.i64("batch", "Sequences in the step."), facts.i64("emitted", "Tokens the step emitted."),
     facts.i64("step_ns", "The engine step's time (else phases_ns); ns.")),
    select=spec_step_rows_sql)

SPEC_DECODE_TOKENS = facts.Fact(
    "spec_decode_tokens", "Every delivered decode token with its mode (speculative or plain), whether it carries "
                          "its step, its batch size and step time, and whether its step had speculating requests.",
    (TOKENS.column(col.REQUEST_ID), TOKENS.column(col.TOKEN_INDEX), facts.i64("lat", "The token's ITL; ns."),
     facts.text("mode", "speculative or plain."), facts.i32("carrier", "1 on the token that carries its step."),
     facts.i64("batch", "Batch size of its step."), facts.i64("step_ns", "Its step's time, on carriers; ns."),
     facts.i32("step_known", "1 when its step's time is known."),
     facts.i32("beside_spec", "1 on a plain token whose step had speculating requests.")),
    select=decode_tokens_sql)
