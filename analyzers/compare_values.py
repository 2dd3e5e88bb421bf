"""What a comparison (:mod:`analyzers.compare`) reads of one run: its latency and stage rows, each stage's median
per token (the derived fact :data:`STAGE_MEDIANS`), and the context rows (:data:`CONTEXT`), as :class:`RunValues`,
computed once per run."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analyzers import facts
from analyzers.diff import run_values
from analyzers.source import Source
from analyzers.timing import request_table, token_times
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, STEPS, TOKENS, Stage, col

__all__ = ["CONTEXT", "STAGE_MEDIANS", "RunValues", "values_of", "context_values"]

CONTEXT: dict[str, str] = {"cache.hit_rate": "fraction", "schedule.preemptions": "count",
                           "engine.utilisation": "fraction", "schedule.queue_depth": "count"}
"""Context rows beside the stage times, and their unit."""


def context_values(src: Source) -> dict[tuple[str, str], float]:
    """The run's context figures (:data:`CONTEXT`): NaN where the run did not measure them."""
    c = col
    hit = src.fetchone(f"""SELECT SUM({c.NUM_CACHED_TOKENS}) / NULLIF(SUM({c.NUM_PROMPT_TOKENS}), 0)
                          FROM {request_table(src)}
                          WHERE {c.NUM_PROMPT_TOKENS} > 0 AND {c.NUM_CACHED_TOKENS} IS NOT NULL""")
    preempted = src.scalar(f"SELECT COUNT(*) FROM {SPANS.name} WHERE {c.STAGE} = {int(Stage.SCHEDULE_PREEMPTED)}")
    steps = src.fetchone(f"""
        SELECT AVG(busy / NULLIF(stepping_ns, 0)), (SELECT AVG({c.NUM_WAITING}) FROM {STEPS.name})
        FROM (SELECT SUM({c.END_NS} - {c.START_NS}) AS busy, MAX({c.END_NS}) - MIN({c.START_NS}) AS stepping_ns
              FROM {STEPS.name} GROUP BY {c.INSTANCE_ID})""")
    has_steps = bool(src.scalar(f"SELECT COUNT(*) FROM {STEPS.name}"))
    has_spans = bool(src.scalar(f"SELECT COUNT(*) FROM {SPANS.name}"))

    def num(v: object) -> float:
        return math.nan if v is None else float(v)  # type: ignore[arg-type]

    return {("cache.hit_rate", "value"): num(hit[0] if hit else None),
            ("schedule.preemptions", "value"): float(preempted or 0) if has_spans else math.nan,
            ("engine.utilisation", "value"): num(steps[0]) if has_steps and steps else math.nan,
            ("schedule.queue_depth", "value"): num(steps[1]) if has_steps and steps else math.nan}


@dataclass(frozen=True, slots=True)
class RunValues:
    """One run's values as a comparison reads them (:func:`values_of`): (metric, statistic) -> value, and the
    sample size behind each latency and stage row. Computed once, a run can be compared many times."""

    values: dict[tuple[str, str], float]
    sizes: dict[tuple[str, str], int]


def values_of(src: Source) -> RunValues:
    """The run's latency and stage rows (:func:`analyzers.diff.run_values`) and its context rows; a run with only
    the load generator's view (``tokentrace bench --store``) gives its TTFT and ITL as the client saw them."""
    vals = run_values(src)
    if vals:
        vals |= _stage_medians(src)
    else:
        vals = _client_values(src)
    return RunValues({k: v for k, (_, v) in vals.items()} | context_values(src), {k: n for k, (n, _) in vals.items()})


def _stage_medians_sql(src: Source) -> str:
    """Per kind of token (token 0 or a later one) and stage, the median over the delivered tokens of that kind of
    the stage's own time for each token (its spans of the stage summed, whole; 0 for a token without one), ms."""
    c = col
    tt = token_times(src)
    return f"""
        WITH per AS (SELECT s.{c.REQUEST_ID}, s.{c.TOKEN_INDEX}, s.{c.STAGE},
                            SUM(GREATEST(0, s.{c.END_NS} - s.{c.START_NS})) AS ns
                     FROM srv_spans s SEMI JOIN {tt} t USING ({c.REQUEST_ID}, {c.TOKEN_INDEX}) GROUP BY ALL),
             stages AS (SELECT DISTINCT {c.STAGE} FROM per)
        SELECT t.{c.TOKEN_INDEX} = 0 AS is_first_token, s.{c.STAGE}, MEDIAN(COALESCE(p.ns, 0)) / 1e6 AS median_ms
        FROM {tt} t CROSS JOIN stages s
        LEFT JOIN per p ON p.{c.REQUEST_ID} = t.{c.REQUEST_ID} AND p.{c.TOKEN_INDEX} = t.{c.TOKEN_INDEX}
                       AND p.{c.STAGE} = s.{c.STAGE}
        GROUP BY ALL"""


STAGE_MEDIANS = facts.Fact(
    "stage_medians", "Per kind of token (token 0 or a later one) and stage with spans: the median over the delivered "
                     "tokens of that kind of the stage's own time for each token (its spans of the stage summed, "
                     "whole; 0 for a token without one). The stage rows (statistic p50) of a comparison.",
    (facts.boolean("is_first_token", "True for token 0 (TTFT), false for the later tokens (ITL)."),
     SPANS.column(col.STAGE),
     facts.f64("median_ms", "The median of the stage's own time per token of the kind; ms.")),
    select=_stage_medians_sql)


def _stage_medians(src: Source) -> dict[tuple[str, str], tuple[int, float]]:
    """Per stage, the median over delivered tokens of the stage's own time for each token (:data:`STAGE_MEDIANS`,
    through :func:`analyzers.facts.relation`: the run's saved copy or built now), per token 0 (``.ttft``) and per
    later token (``.itl``): statistic ``p50``. A stage mean carries every stall of a busy machine (one descheduled
    step of 100 ms moves a mean over a few hundred tokens by a third), and the time inside each token's interval
    hides most of a step when the stream runs behind the engine and delivers tokens in bursts; the median of the
    stage's own time moves with what most tokens spent there, as a delay in every step does."""
    c = col
    per = src.df(f"SELECT is_first_token, {c.STAGE}, median_ms FROM {facts.relation(src, STAGE_MEDIANS)}")
    tokens = src.df(f"SELECT {c.TOKEN_INDEX} = 0 AS first, COUNT(*) AS n FROM {token_times(src)} GROUP BY ALL")
    count = {bool(f): int(n) for f, n in zip(tokens["first"], tokens["n"])}
    got = {(bool(f), int(st)): float(ms) for f, st, ms in zip(per["is_first_token"], per[c.STAGE], per["median_ms"])}
    out = {}
    for kind, first in (("ttft", True), ("itl", False)):
        if count.get(first):
            out.update({(f"stage.{st.label}.{kind}", "p50"): (count[first], got.get((first, int(st)), 0.0))
                        for st in Stage})
    return out


def _client_values(src: Source) -> dict[tuple[str, str], tuple[int, float]]:
    from analyzers.agreement import CLIENT_NS, client_token_times
    from analyzers.diff import STATISTICS

    tables = (REQUESTS.name, TOKENS.name, INSTANCES.name)
    per_token = client_token_times(*(src.arrow(f"SELECT * FROM {t}") for t in tables))
    first = per_token[col.TOKEN_INDEX].to_numpy() == 0
    out = {}
    for metric, x in (("ttft", per_token[CLIENT_NS].to_numpy(float)[first] / 1e6),
                      ("itl", per_token[CLIENT_NS].to_numpy(float)[~first] / 1e6)):
        if x.size:
            out.update({(metric, name): (int(x.size), float(x.mean() if q is None else np.percentile(x, q)))
                        for name, q in STATISTICS.items()})
    return out
