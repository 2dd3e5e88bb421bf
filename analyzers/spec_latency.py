"""Speculative decoding against plain decoding: ITL measured and amortized, and where speculation was slower.

Definitions: :mod:`analyzers.speculative` (With and without speculation; Where speculation hurt). Called
through :func:`analyzers.speculative.speculation` or on their own.
"""

from __future__ import annotations

import math

import pandas as pd

from analyzers.source import Source
from analyzers.spec_rows import (
    PLAIN,
    SPECULATIVE,
    bin_lo,
    bin_sql,
    empty_frame,
    has_speculation,
    token_rows_sql,
)
from analyzers.stats import holm, normal_p_value

__all__ = ["itl_by_mode", "by_batch_size", "plain_neighbours", "MIN_EFFECT_MS", "MIN_TOKENS", "BESIDE_SPEC",
           "NO_SPEC_IN_STEP"]

MIN_EFFECT_MS = 0.1  # smallest ITL difference (ms) flagged as speculation being slower
MIN_TOKENS = 10  # tokens each side of a batch-size bin needs before it is judged
_ALPHA = 0.05
BESIDE_SPEC = "beside speculating requests"
NO_SPEC_IN_STEP = "no speculation in the step"


_MODE_COLUMNS = {"mode": "object", "num_steps": "int64", "num_tokens": "int64", "tokens_per_step": "float64",
                 "mean_itl_ms": "float64", "p50_itl_ms": "float64", "p99_itl_ms": "float64",
                 "mean_carrier_itl_ms": "float64", "mean_step_ms": "float64", "ms_per_token": "float64"}


def _mode_stats(src: Source, *, by: str = "") -> pd.DataFrame:
    """Per mode, and per mode and ``by``: ``"batch"`` (batch-size bin, bins of unknown size left out) or
    ``"beside"`` (plain tokens whose step had speculating requests or not): token counts, ITL
    mean/variance/percentiles (ns), step time sums. The three groupings come from one query (grouping sets),
    run once per source."""
    def build() -> pd.DataFrame:
        return src.df(f"""
            WITH {token_rows_sql(src)}, binned AS (
                SELECT decode_tokens.*, {bin_sql('batch')} AS batch_size_hi FROM decode_tokens
            )
            SELECT mode, batch_size_hi, beside_spec, GROUPING(batch_size_hi) AS every_bin,
                   GROUPING(beside_spec) AS every_step,
                   COUNT(*) AS num_tokens, SUM(carrier) AS num_steps,
                   AVG(CAST(lat AS DOUBLE)) AS mean_ns, VAR_SAMP(CAST(lat AS DOUBLE)) AS var_ns,
                   quantile_cont(lat, 0.5) AS p50_ns, quantile_cont(lat, 0.99) AS p99_ns,
                   AVG(CASE WHEN carrier = 1 THEN CAST(lat AS DOUBLE) END) AS carrier_ns,
                   SUM(step_ns) AS step_ns, SUM(CASE WHEN step_ns IS NOT NULL THEN 1 ELSE 0 END) AS timed_steps,
                   SUM(step_known) AS timed_tokens
            FROM binned
            GROUP BY GROUPING SETS ((mode), (mode, batch_size_hi), (mode, beside_spec))
        """)
    stats = src.cached("spec_mode_stats", build)
    if by == "batch":
        return stats[(stats["every_bin"] == 0) & stats["batch_size_hi"].notna()].reset_index(drop=True)
    if by == "beside":
        return stats[(stats["every_step"] == 0) & (stats["mode"] == PLAIN)].reset_index(drop=True)
    return stats[(stats["every_bin"] == 1) & (stats["every_step"] == 1)].reset_index(drop=True)


def _mode_frame(stats: pd.DataFrame) -> pd.DataFrame:
    num_steps = stats["num_steps"].astype(float)
    timed_steps = stats["timed_steps"].astype(float).where(stats["timed_steps"] > 0)
    timed_tokens = stats["timed_tokens"].astype(float).where(stats["timed_tokens"] > 0)
    return pd.DataFrame({
        "num_steps": stats["num_steps"].astype("int64"), "num_tokens": stats["num_tokens"].astype("int64"),
        "tokens_per_step": stats["num_tokens"] / num_steps.where(num_steps > 0),
        "mean_itl_ms": stats["mean_ns"] / 1e6, "p50_itl_ms": stats["p50_ns"] / 1e6,
        "p99_itl_ms": stats["p99_ns"] / 1e6, "mean_carrier_itl_ms": stats["carrier_ns"] / 1e6,
        "mean_step_ms": stats["step_ns"].astype(float) / timed_steps / 1e6,
        "ms_per_token": stats["step_ns"].astype(float) / timed_tokens / 1e6,
    }, index=stats.index)


def itl_by_mode(src: Source) -> pd.DataFrame:
    """Rows ``speculative`` and ``plain`` (a mode without tokens is left out): num_steps, num_tokens,
    tokens_per_step, measured ITL (mean_itl_ms, p50_itl_ms, p99_itl_ms over every token of the mode;
    mean_carrier_itl_ms over the tokens that carry a step), mean_step_ms (engine step time) and
    ms_per_token (amortized: step time over the tokens those steps emitted). Empty without speculation."""
    if not has_speculation(src):
        return empty_frame(_MODE_COLUMNS)
    stats = _mode_stats(src)
    out = _mode_frame(stats)
    out.insert(0, "mode", stats["mode"])
    order = {SPECULATIVE: 0, PLAIN: 1}
    out = out.sort_values("mode", key=lambda s: s.map(order)).reset_index(drop=True)
    return out.astype(_MODE_COLUMNS)


_BATCH_COLUMNS = {"batch_size_lo": "int64", "batch_size_hi": "int64", "spec_tokens": "int64",
                  "plain_tokens": "int64", "spec_mean_itl_ms": "float64", "plain_mean_itl_ms": "float64",
                  "itl_delta_ms": "float64", "spec_ms_per_token": "float64", "plain_ms_per_token": "float64",
                  "spec_tokens_per_step": "float64", "p_value": "float64", "p_adjusted": "float64",
                  "slower": "bool"}


def by_batch_size(src: Source, *, min_effect_ms: float = MIN_EFFECT_MS, min_tokens: int = MIN_TOKENS
                  ) -> pd.DataFrame:
    """Per batch-size bin, speculative against plain decode tokens: spec_tokens, plain_tokens, their mean ITL,
    itl_delta_ms (speculative - plain), amortized ms_per_token of each, spec_tokens_per_step, the two-sided
    p_value of the ITL difference (Welch's z), p_adjusted (Holm over the judged bins) and ``slower``. Bins where
    one side has no token keep NaN there. Empty without speculation."""
    if min_effect_ms < 0:
        raise ValueError(f"min_effect_ms must be >= 0, got {min_effect_ms!r}")
    if min_tokens < 2:
        raise ValueError(f"min_tokens must be >= 2 (a variance needs two tokens), got {min_tokens!r}")
    if not has_speculation(src):
        return empty_frame(_BATCH_COLUMNS)
    stats = _mode_stats(src, by="batch")
    frame = _mode_frame(stats).assign(mode=stats["mode"], batch_size_hi=stats["batch_size_hi"].astype("int64"),
                                      var_ns=stats["var_ns"])
    spec = frame[frame["mode"] == SPECULATIVE].set_index("batch_size_hi")
    plain = frame[frame["mode"] == PLAIN].set_index("batch_size_hi")
    bins = sorted(set(spec.index) | set(plain.index))
    rows = []
    for hi in bins:
        s = spec.loc[hi] if hi in spec.index else None
        p = plain.loc[hi] if hi in plain.index else None
        n_s = int(s["num_tokens"]) if s is not None else 0
        n_p = int(p["num_tokens"]) if p is not None else 0
        m_s = float(s["mean_itl_ms"]) if s is not None else math.nan
        m_p = float(p["mean_itl_ms"]) if p is not None else math.nan
        p_value = math.nan
        if n_s >= min_tokens and n_p >= min_tokens:
            se_ms = math.sqrt(float(s["var_ns"]) / n_s + float(p["var_ns"]) / n_p) / 1e6
            p_value = normal_p_value(m_s - m_p, se_ms)
        rows.append({"batch_size_lo": bin_lo(int(hi)), "batch_size_hi": int(hi), "spec_tokens": n_s,
                     "plain_tokens": n_p, "spec_mean_itl_ms": m_s, "plain_mean_itl_ms": m_p,
                     "itl_delta_ms": m_s - m_p,
                     "spec_ms_per_token": float(s["ms_per_token"]) if s is not None else math.nan,
                     "plain_ms_per_token": float(p["ms_per_token"]) if p is not None else math.nan,
                     "spec_tokens_per_step": float(s["tokens_per_step"]) if s is not None else math.nan,
                     "p_value": p_value})
    df = pd.DataFrame(rows, columns=[c for c in _BATCH_COLUMNS if c not in ("p_adjusted", "slower")])
    df["p_adjusted"] = holm(df["p_value"].to_numpy(float)) if len(df) else []
    df["slower"] = (df["p_adjusted"] < _ALPHA) & (df["itl_delta_ms"] >= min_effect_ms)
    return df.astype(_BATCH_COLUMNS)


_NEIGHBOUR_COLUMNS = {"step": "object", "num_tokens": "int64", "mean_itl_ms": "float64", "p50_itl_ms": "float64",
                      "p99_itl_ms": "float64", "mean_step_ms": "float64"}


def plain_neighbours(src: Source) -> pd.DataFrame:
    """Plain decode tokens by their engine step: ``no speculation in the step`` against ``beside speculating
    requests`` (a mixed batch, whose plain requests wait for the draft and the longer verify pass too):
    num_tokens, mean_itl_ms, p50_itl_ms, p99_itl_ms, mean_step_ms. A group without tokens is left out (plain
    tokens without a recorded step count as not beside speculation). Empty without speculation."""
    if not has_speculation(src):
        return empty_frame(_NEIGHBOUR_COLUMNS)
    stats = _mode_stats(src, by="beside").sort_values("beside_spec")
    frame = _mode_frame(stats)
    out = pd.DataFrame({"step": [BESIDE_SPEC if b else NO_SPEC_IN_STEP for b in stats["beside_spec"]]},
                       index=stats.index)
    for column in list(_NEIGHBOUR_COLUMNS)[1:]:
        out[column] = frame[column]
    return out.reset_index(drop=True).astype(_NEIGHBOUR_COLUMNS)
