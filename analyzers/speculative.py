"""Speculative decoding: how often the draft was right, what drafting cost, and where it did not pay.

Reads ``spec_steps`` (one row per request per speculative engine step), the shared
per-token facts (:mod:`analyzers.timing`), ``steps`` and ``spans``. With ``k`` =
``num_proposed`` and ``a`` = ``num_accepted`` of a row:

* **emitted**: the tokens the step delivered, i.e. the request's delivered tokens
  with index in ``[first_token_index, first_token_index + a]``: ``a + 1``, fewer
  when the request finished within the step (``a + 1`` when the request has no
  delivered token recorded at all).
* **Acceptance rate** = sum a / sum k. **By draft position** ``j`` (1..k): of the
  steps that proposed at least ``j`` tokens, the share whose proposal ``j`` was
  accepted (``a >= j``; acceptance is a prefix); ``conditional_acceptance_rate``:
  the same among the steps whose proposal ``j - 1`` was accepted.
* **Accepted per verify step**: the distribution of ``a``; tokens per step = sum
  emitted / steps.
* **Draft cost**: draft = ``draft_end - draft_start``, verify = ``verify_end -
  verify_start``, summed over rows (a draft batched over several requests counts
  once per request that waited on it, as the requests' own stage time does).
  ``draft_share`` = draft / (draft + verify); ``draft_share_of_decode`` = draft /
  (draft + verify + the ``decode.compute`` spans of plain decode steps).
* **Rejected work**: ``rejected_draft_ms`` = sum draft x (k - a) / k (a proposal
  costs the same share of its draft phase); verify positions: the pass verifies
  ``k + 1`` positions, of which ``k + 1 - emitted`` gave no token.
* **With and without speculation**: a decode token (index >= 1) is
  ``speculative`` when a row of its request covers its index, else ``plain``. The
  first token of a speculative step carries the step (its interval holds
  decode.draft and decode.verify); the others follow at the same instant, so their
  ITL is their own send time. Measured ITL is over every token of a mode; the
  **amortized** cost per token = sum step time / sum tokens of those steps, step
  time being the engine step's duration (``steps``; a speculative step without a
  ``steps`` row: draft start to verify end).
* **Plain neighbours**: plain decode tokens whose engine step had speculating requests (a mixed batch: they
  wait for the draft and the longer verify pass) against plain tokens of steps without speculation.
* **Where speculation hurt**: per batch-size bin (powers of two, as
  :func:`analyzers.batch.batch_profile`): the batch size of a speculative token is
  its step's ``batch_num_seqs``, of a plain one its engine step's
  ``step_num_seqs``. ``slower`` flags a bin whose speculative mean ITL exceeds the
  plain one by at least ``min_effect_ms`` and significantly (Welch's z on the
  means, Holm-adjusted over the bins, p < 0.05), both sides holding at least
  ``min_tokens`` tokens.

A run without ``spec_steps`` rows gives empty tables. The SQL (:mod:`analyzers.spec_rows`) is
standard SQL in DuckDB's dialect (percentiles: ``quantile_cont``, as the other analyzers), run through
the source's engine, so it runs on Spark too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.source import Source
from analyzers.spec_latency import MIN_EFFECT_MS, MIN_TOKENS, by_batch_size, itl_by_mode, plain_neighbours
from analyzers.spec_rows import (
    PLAIN,
    SPECULATIVE,
    bin_lo,
    bin_sql,
    empty_frame,
    has_speculation,
    ratio,
    spec_rows_sql,
)
from tokentrace.schema import SPEC_STEPS, DraftSource, Stage, col

__all__ = ["SpecReport", "speculation", "acceptance", "acceptance_by_position", "accepted_per_step", "draft_cost",
           "rejected_work", "itl_by_mode", "by_batch_size", "plain_neighbours", "GROUPINGS", "SPECULATIVE", "PLAIN",
           "MIN_EFFECT_MS", "MIN_TOKENS"]

GROUPINGS: dict[str, str] = {"request": col.REQUEST_ID, "tenant": col.TENANT, "batch_size": col.BATCH_SIZE,
                             col.DRAFT_SOURCE: col.DRAFT_SOURCE}
"""Values of :func:`acceptance`'s ``by`` and the column each groups on."""


# ---------------------------------------------------------------- acceptance

_POSITION_COLUMNS = {"position": "int64", "num_steps": "int64", col.NUM_ACCEPTED: "int64", "acceptance_rate": "float64",
                     "conditional_acceptance_rate": "float64"}


def _proposal_counts(src: Source) -> pd.DataFrame:
    """Steps per (k, a, emitted) pair: the small table the position and histogram figures come from."""
    def build() -> pd.DataFrame:
        return src.df(f"""
            WITH {spec_rows_sql(src)}
            SELECT k, a, emitted, COUNT(*) AS num_steps FROM spec_rows GROUP BY k, a, emitted
        """)
    return src.cached("spec_proposal_counts", build)


def acceptance_by_position(src: Source) -> pd.DataFrame:
    """Per draft position 1..max k: position, num_steps (steps that proposed it), num_accepted,
    acceptance_rate, conditional_acceptance_rate (among the steps whose previous proposal was accepted)."""
    if not has_speculation(src):
        return empty_frame(_POSITION_COLUMNS)
    counts = _proposal_counts(src)
    k = counts["k"].to_numpy(dtype=np.int64)
    a = counts["a"].to_numpy(dtype=np.int64)
    n = counts["num_steps"].to_numpy(dtype=np.int64)
    rows = []
    for j in range(1, int(k.max(initial=0)) + 1):
        proposed = k >= j
        num_steps = int(n[proposed].sum())
        num_accepted = int(n[proposed & (a >= j)].sum())
        reached = int(n[proposed & (a >= j - 1)].sum())  # proposal j - 1 accepted (always, for j = 1)
        rows.append((j, num_steps, num_accepted, ratio(num_accepted, num_steps), ratio(num_accepted, reached)))
    return pd.DataFrame(rows, columns=list(_POSITION_COLUMNS)).astype(_POSITION_COLUMNS)


_HISTOGRAM_COLUMNS = {col.NUM_ACCEPTED: "int64", "num_steps": "int64", "share": "float64"}


def accepted_per_step(src: Source) -> pd.DataFrame:
    """The distribution of accepted proposals per verify step: num_accepted (0..max k), num_steps, share
    (every count from 0 to the largest k, zeros included)."""
    if not has_speculation(src):
        return empty_frame(_HISTOGRAM_COLUMNS)
    counts = _proposal_counts(src)
    by_a = counts.groupby("a")["num_steps"].sum()
    top = int(max(counts["k"].max(), counts["a"].max()))
    steps = [int(by_a.get(i, 0)) for i in range(top + 1)]
    total = sum(steps)
    return pd.DataFrame({col.NUM_ACCEPTED: range(top + 1), "num_steps": steps,
                         "share": [s / total for s in steps]}).astype(_HISTOGRAM_COLUMNS)


_GROUP_SUMS = """COUNT(*) AS num_steps, SUM(k) AS num_proposed, SUM(a) AS num_accepted,
                 SUM(emitted) AS num_emitted, SUM(draft_ns) AS draft_ns, SUM(verify_ns) AS verify_ns"""


def _with_rates(df: pd.DataFrame) -> pd.DataFrame:
    """Sums per group -> rates: acceptance_rate, mean_accepted_per_step, mean_tokens_per_step, draft_share."""
    num_steps = df["num_steps"].astype(float)
    out = df.assign(
        acceptance_rate=df[col.NUM_ACCEPTED] / df[col.NUM_PROPOSED].where(df[col.NUM_PROPOSED] > 0),
        mean_accepted_per_step=df[col.NUM_ACCEPTED] / num_steps,
        mean_tokens_per_step=df["num_emitted"] / num_steps,
        draft_share=df["draft_ns"] / (df["draft_ns"] + df["verify_ns"]).where(lambda s: s > 0),
    )
    return out.drop(columns=["draft_ns", "verify_ns"])


_SUMS = ["num_steps", col.NUM_PROPOSED, col.NUM_ACCEPTED, "num_emitted", "draft_ns", "verify_ns"]  # of _GROUP_SUMS


def _per_request(src: Source) -> pd.DataFrame:
    """Per speculating request: request_id, request_key, tenant_name and :data:`_SUMS` (one query, once per
    source; the tenants' rows are its sums)."""
    def build() -> pd.DataFrame:
        c = col
        return src.df(f"""
            WITH {spec_rows_sql(src)}, req AS (
                SELECT {c.REQUEST_ID}, MAX({c.REQUEST_KEY}) AS {c.REQUEST_KEY}, MAX({c.TENANT}) AS {c.TENANT}
                FROM srv_requests GROUP BY {c.REQUEST_ID}
            ), per_request AS (
                SELECT {c.REQUEST_ID}, {_GROUP_SUMS} FROM spec_rows GROUP BY {c.REQUEST_ID}
            )
            SELECT p.{c.REQUEST_ID}, COALESCE(r.{c.REQUEST_KEY}, '') AS {c.REQUEST_KEY},
                   COALESCE(r.{c.TENANT}, '') AS {c.TENANT}, {', '.join('p.' + s for s in _SUMS)}
            FROM per_request p LEFT JOIN req r ON r.{c.REQUEST_ID} = p.{c.REQUEST_ID}
        """)
    return src.cached("spec_per_request", build).copy()


def acceptance(src: Source, *, by: str | None = None) -> pd.DataFrame:
    """Acceptance overall (one row) or per ``by`` in :data:`GROUPINGS`: num_steps, num_proposed, num_accepted,
    num_emitted, acceptance_rate, mean_accepted_per_step, mean_tokens_per_step, draft_share.

    ``by="request"``: request_id, request_key and tenant_name first; ``"tenant"``: tenant_name; ``"batch_size"``:
    batch_size_lo, batch_size_hi (power-of-two bins of the verify pass's sequences); ``col.DRAFT_SOURCE``: its label.
    """
    if by is not None and by not in GROUPINGS:
        raise ValueError(f"by must be one of {', '.join(GROUPINGS)} (or None), got {by!r}")
    c = col
    keys = {None: [], "request": [c.REQUEST_ID], "tenant": [c.TENANT], "batch_size": ["batch_size_hi"],
            col.DRAFT_SOURCE: [c.DRAFT_SOURCE]}[by]
    sums = _SUMS
    if not has_speculation(src):
        head = {"request": {c.REQUEST_ID: "int64", c.REQUEST_KEY: "object", c.TENANT: "object"},
                "tenant": {c.TENANT: "object"}, "batch_size": {"batch_size_lo": "int64", "batch_size_hi": "int64"},
                col.DRAFT_SOURCE: {c.DRAFT_SOURCE: "object"}}.get(by or "", {})
        return _with_rates(empty_frame({**head, **{s: "int64" for s in sums}}))
    rows_cte = spec_rows_sql(src)
    if by in ("request", "tenant"):
        df = _per_request(src)
        if by == "tenant":
            df = df.groupby(c.TENANT, as_index=False)[sums].sum()
        df = df.sort_values(keys).reset_index(drop=True)
    elif by == "batch_size":
        df = src.df(f"""
            WITH {rows_cte}
            SELECT {bin_sql('batch')} AS batch_size_hi, {_GROUP_SUMS} FROM spec_rows
            WHERE batch IS NOT NULL GROUP BY {bin_sql('batch')} ORDER BY batch_size_hi
        """)
        df.insert(0, "batch_size_lo", [bin_lo(int(h)) for h in df["batch_size_hi"]])
    else:
        group = f"GROUP BY {keys[0]} ORDER BY {keys[0]}" if keys else ""
        df = src.df(f"WITH {rows_cte} SELECT {', '.join(keys + [_GROUP_SUMS])} FROM spec_rows {group}")
        if by == col.DRAFT_SOURCE:
            df[c.DRAFT_SOURCE] = [_source_label(v) for v in df[c.DRAFT_SOURCE]]
    for s in sums:
        df[s] = df[s].fillna(0).astype("int64")
    return _with_rates(df.reset_index(drop=True))


def _source_label(value: object) -> str:
    try:
        return DraftSource(int(value)).label  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "unknown"


# ---------------------------------------------------------------- cost and waste

_COST_COLUMNS = {"num_steps": "int64", "draft_ms": "float64", "verify_ms": "float64", "plain_compute_ms": "float64",
                 "draft_share": "float64", "verify_share": "float64", "draft_share_of_decode": "float64",
                 "spec_share_of_decode": "float64"}


def _totals(src: Source) -> pd.Series:
    """Every one-row sum over the run's speculative steps (one query, once per source): what the summary,
    draft cost and rejected-work tables are made of."""
    def build() -> pd.Series:
        c = col
        return src.df(f"""
            WITH {spec_rows_sql(src)}
            SELECT COUNT(DISTINCT {c.REQUEST_ID}) AS num_requests, COUNT(*) AS num_steps, SUM(k) AS num_proposed,
                   SUM(a) AS num_accepted, SUM(emitted) AS num_emitted, MAX(k) AS max_proposed,
                   SUM(draft_ns) AS draft_ns, SUM(verify_ns) AS verify_ns,
                   SUM(CASE WHEN k > 0 THEN CAST(draft_ns AS DOUBLE) * (k - a) / k ELSE 0 END) AS rejected_draft_ns,
                   SUM(k + 1) AS verify_positions, SUM(k + 1 - emitted) AS wasted_positions,
                   SUM(CAST(verify_ns AS DOUBLE) * (k + 1 - emitted) / (k + 1)) AS wasted_verify_ns,
                   (SELECT SUM({c.END_NS} - {c.START_NS}) FROM srv_spans
                    WHERE {c.STAGE} = {int(Stage.DECODE_COMPUTE)}) AS plain_ns
            FROM spec_rows
        """).iloc[0]
    return src.cached("spec_totals", build)


def draft_cost(src: Source) -> pd.DataFrame:
    """One row: num_steps, draft_ms, verify_ms, plain_compute_ms (decode.compute spans of plain decode steps),
    draft_share (of draft + verify), verify_share, draft_share_of_decode and spec_share_of_decode (draft, and
    draft + verify, over all decode compute time: draft + verify + plain compute). Empty without speculation."""
    if not has_speculation(src):
        return empty_frame(_COST_COLUMNS)
    row = _totals(src)
    draft, verify = float(row["draft_ns"] or 0), float(row["verify_ns"] or 0)
    plain = 0.0 if pd.isna(row["plain_ns"]) else float(row["plain_ns"])
    decode = draft + verify + plain
    return pd.DataFrame([{
        "num_steps": int(row["num_steps"]), "draft_ms": draft / 1e6, "verify_ms": verify / 1e6,
        "plain_compute_ms": plain / 1e6, "draft_share": ratio(draft, draft + verify),
        "verify_share": ratio(verify, draft + verify), "draft_share_of_decode": ratio(draft, decode),
        "spec_share_of_decode": ratio(draft + verify, decode)}]).astype(_COST_COLUMNS)


_WASTE_COLUMNS = {col.NUM_PROPOSED: "int64", "num_rejected": "int64", "rejected_share": "float64",
                  "draft_ms": "float64", "rejected_draft_ms": "float64", "rejected_draft_share": "float64",
                  "verify_positions": "int64", "wasted_verify_positions": "int64", "wasted_verify_share": "float64",
                  "wasted_verify_ms": "float64"}


def rejected_work(src: Source) -> pd.DataFrame:
    """One row: num_proposed, num_rejected (k - a), rejected_share; draft_ms, rejected_draft_ms (draft x
    (k - a) / k per step) and its share of draft time; verify_positions (k + 1 per step),
    wasted_verify_positions (k + 1 - emitted), their share, and wasted_verify_ms (verify time x wasted /
    (k + 1)). Empty without speculation."""
    if not has_speculation(src):
        return empty_frame(_WASTE_COLUMNS)
    r = _totals(src)
    draft = float(r["draft_ns"] or 0)
    return pd.DataFrame([{
        col.NUM_PROPOSED: int(r[col.NUM_PROPOSED]), "num_rejected": int(r[col.NUM_PROPOSED] - r[col.NUM_ACCEPTED]),
        "rejected_share": ratio(r[col.NUM_PROPOSED] - r[col.NUM_ACCEPTED], r[col.NUM_PROPOSED]), "draft_ms": draft / 1e6,
        "rejected_draft_ms": float(r["rejected_draft_ns"]) / 1e6,
        "rejected_draft_share": ratio(r["rejected_draft_ns"], draft),
        "verify_positions": int(r["verify_positions"]), "wasted_verify_positions": int(r["wasted_positions"]),
        "wasted_verify_share": ratio(r["wasted_positions"], r["verify_positions"]),
        "wasted_verify_ms": float(r["wasted_verify_ns"]) / 1e6}]).astype(_WASTE_COLUMNS)


# ---------------------------------------------------------------- everything at once

_SUMMARY_COLUMNS = {"draft_sources": "object", "num_requests": "int64", "num_steps": "int64",
                    col.NUM_PROPOSED: "int64", col.NUM_ACCEPTED: "int64", "num_emitted": "int64",
                    "acceptance_rate": "float64", "mean_accepted_per_step": "float64",
                    "mean_tokens_per_step": "float64", "max_proposed": "int64"}


def _summary(src: Source) -> pd.DataFrame:
    if not has_speculation(src):
        return empty_frame(_SUMMARY_COLUMNS)
    c = col
    r = _totals(src)
    sources = src.df(f"SELECT DISTINCT {c.DRAFT_SOURCE} FROM {SPEC_STEPS.name} ORDER BY {c.DRAFT_SOURCE}")
    steps = int(r["num_steps"])
    return pd.DataFrame([{
        "draft_sources": ", ".join(_source_label(v) for v in sources[c.DRAFT_SOURCE]),
        "num_requests": int(r["num_requests"]), "num_steps": steps, col.NUM_PROPOSED: int(r[col.NUM_PROPOSED]),
        col.NUM_ACCEPTED: int(r[col.NUM_ACCEPTED]), "num_emitted": int(r["num_emitted"]),
        "acceptance_rate": ratio(r[col.NUM_ACCEPTED], r[col.NUM_PROPOSED]),
        "mean_accepted_per_step": ratio(r[col.NUM_ACCEPTED], steps),
        "mean_tokens_per_step": ratio(r["num_emitted"], steps),
        "max_proposed": int(r["max_proposed"])}]).astype(_SUMMARY_COLUMNS)


@dataclass(frozen=True, slots=True, eq=False)
class SpecReport:
    """Every speculative-decoding figure of a run (:func:`speculation`); every frame empty without speculation."""

    summary: pd.DataFrame  # one row: sources, requests, steps, proposed/accepted/emitted, acceptance rate
    by_position: pd.DataFrame  # acceptance_by_position
    accepted_per_step: pd.DataFrame  # histogram of accepted proposals per verify step
    by_request: pd.DataFrame  # acceptance(by="request")
    by_tenant: pd.DataFrame  # acceptance(by="tenant")
    by_batch_acceptance: pd.DataFrame  # acceptance(by="batch_size")
    cost: pd.DataFrame  # draft_cost
    rejected: pd.DataFrame  # rejected_work
    itl: pd.DataFrame  # itl_by_mode
    by_batch: pd.DataFrame  # by_batch_size: where speculation hurt
    neighbours: pd.DataFrame  # plain_neighbours: plain tokens beside speculating requests or not
    min_effect_ms: float = MIN_EFFECT_MS  # what by_batch's ``slower`` needed
    min_tokens: int = MIN_TOKENS

    @property
    def is_empty(self) -> bool:
        """True when the run has no speculative step."""
        return len(self.summary) == 0

    @property
    def slower_batches(self) -> pd.DataFrame:
        """The rows of :attr:`by_batch` flagged ``slower``."""
        return self.by_batch[self.by_batch["slower"]].reset_index(drop=True)


def speculation(src: Source, *, min_effect_ms: float = MIN_EFFECT_MS, min_tokens: int = MIN_TOKENS) -> SpecReport:
    """All of this module's figures (see the module doc)."""
    return SpecReport(
        summary=_summary(src), by_position=acceptance_by_position(src), accepted_per_step=accepted_per_step(src),
        by_request=acceptance(src, by="request"), by_tenant=acceptance(src, by="tenant"),
        by_batch_acceptance=acceptance(src, by="batch_size"), cost=draft_cost(src), rejected=rejected_work(src),
        itl=itl_by_mode(src), by_batch=by_batch_size(src, min_effect_ms=min_effect_ms, min_tokens=min_tokens),
        neighbours=plain_neighbours(src),
        min_effect_ms=min_effect_ms, min_tokens=min_tokens)
