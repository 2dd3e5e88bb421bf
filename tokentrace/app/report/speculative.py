"""Speculative decoding in words: the sentences and tables the report and the dashboard share.

Pure functions of an ``analyzers.speculative.SpecReport`` (passed in; nothing is
imported from the analyzers here). A run without speculation gets one sentence,
:data:`NO_SPECULATION`.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from tokentrace.app.report.frames import as_float
from tokentrace.schema import col

__all__ = ["NO_SPECULATION", "speculation_sentences", "speculation_tables", "slower_sentence", "neighbours_sentence",
           "spec_metrics"]

NO_SPECULATION = ("No speculative decoding in this run: it has no spec_steps rows (a server that speculates "
                  "records one per request and speculative step).")


def _pct(value: Any) -> str:
    v = as_float(value)
    return f"{v:.1%}" if math.isfinite(v) else "not measured"


def _ms(value: Any, digits: int = 2) -> str:
    v = as_float(value)
    return f"{v:,.{digits}f} ms" if math.isfinite(v) else "not measured"


def _acceptance(s: pd.Series) -> str:
    return (f"{int(s['num_steps']):,} speculative step(s) of {int(s['num_requests']):,} request(s) "
            f"(drafts from {s['draft_sources'] or 'an unknown source'}, up to {int(s['max_proposed'])} per step) "
            f"proposed {int(s[col.NUM_PROPOSED]):,} tokens: {_pct(s['acceptance_rate'])} were accepted, "
            f"{as_float(s['mean_accepted_per_step']):.2f} per verify step, and a step emitted "
            f"{as_float(s['mean_tokens_per_step']):.2f} tokens on average.")


def _cost(cost: pd.DataFrame, rejected: pd.DataFrame) -> str:
    if len(cost) == 0 or len(rejected) == 0:
        return ""
    c, r = cost.iloc[0], rejected.iloc[0]
    return (f"Drafting took {_pct(c['draft_share'])} of the draft and verify time and "
            f"{_pct(c['draft_share_of_decode'])} of all decode compute time; {_ms(r['rejected_draft_ms'], 1)} of "
            f"draft time ({_pct(r['rejected_draft_share'])}) went to proposals the target rejected, and "
            f"{int(r['wasted_verify_positions']):,} of {int(r['verify_positions']):,} verified positions "
            f"({_pct(r['wasted_verify_share'])}) gave no token.")


def _itl(itl: pd.DataFrame) -> str:
    by_mode = itl.set_index("mode") if len(itl) else pd.DataFrame()
    if "speculative" not in by_mode.index:
        return "No speculative step delivered a token to time."
    s = by_mode.loc["speculative"]
    spec = (f"Per decode token, speculative steps cost {_ms(s['ms_per_token'])} of engine step time amortized "
            f"over the tokens they emitted (measured mean ITL {_ms(s['mean_itl_ms'])}; the token that carries "
            f"each step waited {_ms(s['mean_carrier_itl_ms'])})")
    if "plain" not in by_mode.index:
        return spec + "; no plain decode step to compare with."
    p = by_mode.loc["plain"]
    return spec + f", against {_ms(p['ms_per_token'])} (measured {_ms(p['mean_itl_ms'])}) for plain decode steps."


def slower_sentence(by_batch: pd.DataFrame, *, min_tokens: int) -> str:
    """Where speculation was slower than plain decoding, by batch size, in one sentence."""
    judged = by_batch[by_batch["p_value"].notna()] if len(by_batch) else by_batch
    if len(judged) == 0:
        return (f"No batch size had {min_tokens} speculative and {min_tokens} plain decode tokens to compare "
                "speculation against plain decoding.")
    slower = judged[judged["slower"].astype(bool)]
    if len(slower) == 0:
        return (f"Speculation was not slower than plain decoding at any of the {len(judged)} batch size bin(s) "
                f"with at least {min_tokens} tokens each side.")
    parts = [f"{_sizes(r)} (+{as_float(r['itl_delta_ms']):,.2f} ms mean ITL, {as_float(r['spec_mean_itl_ms']):,.2f} against "
             f"{as_float(r['plain_mean_itl_ms']):,.2f} ms; p = {as_float(r['p_adjusted']):.2g}, "
             f"n = {int(r['spec_tokens']):,} / {int(r['plain_tokens']):,} tokens)" for _, r in slower.iterrows()]
    return "Speculation was slower than plain decoding at batch size " + "; ".join(parts) + "."


def neighbours_sentence(neighbours: pd.DataFrame) -> str:
    """Plain decode tokens beside speculating requests against those of steps without speculation; '' unless
    both kinds of step had plain tokens."""
    if len(neighbours) < 2:
        return ""
    by_step = neighbours.set_index("step")
    beside, alone = by_step.iloc[1], by_step.iloc[0]  # (the analyzer's order: without, then beside)
    return (f"Plain decode tokens that shared their step with speculating requests had a mean ITL of "
            f"{_ms(beside['mean_itl_ms'])} ({int(beside['num_tokens']):,} tokens) against {_ms(alone['mean_itl_ms'])} "
            f"in steps without speculation ({int(alone['num_tokens']):,} tokens).")


def _sizes(r: pd.Series) -> str:
    lo, hi = int(r["batch_size_lo"]), int(r["batch_size_hi"])
    return str(hi) if lo == hi else f"{lo}-{hi}"


def speculation_sentences(rep: Any) -> list[str]:
    """What the run's speculation did, in a few sentences (:data:`NO_SPECULATION` when it had none)."""
    if rep.is_empty:
        return [NO_SPECULATION]
    out = [_acceptance(rep.summary.iloc[0]), _cost(rep.cost, rep.rejected), _itl(rep.itl),
           slower_sentence(rep.by_batch, min_tokens=rep.min_tokens), neighbours_sentence(rep.neighbours)]
    return [s for s in out if s]


def speculation_tables(rep: Any) -> tuple[tuple[str, pd.DataFrame], ...]:
    """(caption, table) pairs of the report's section, non-empty ones only."""
    pairs = (  # the narrow tables first: a terminal shows the first two
        ("Acceptance by draft position (share of the steps that proposed it)", rep.by_position),
        ("Accepted proposals per verify step", rep.accepted_per_step),
        ("Speculative steps: proposals, acceptance and tokens per step", rep.summary),
        ("Draft cost: draft and verify time, and their share of decode compute", rep.cost),
        ("Rejected draft work and wasted verify positions", rep.rejected),
        ("ITL with and without speculation: measured, and amortized per token", rep.itl),
        ("Where speculation hurt: speculative against plain decode tokens by batch size", rep.by_batch),
        ("Plain decode tokens beside speculating requests (a mixed batch) and in steps without speculation",
         rep.neighbours),
        ("Acceptance by batch size", rep.by_batch_acceptance),
        ("Acceptance by tenant", rep.by_tenant),
    )
    return tuple((c, df) for c, df in pairs if len(df))


def spec_metrics(rep: Any) -> dict[str, float]:
    """The budget metrics ``spec.*`` (fractions; ms for the times) of a run that speculated; empty without it."""
    if rep.is_empty:
        return {}
    by_mode = rep.itl.set_index("mode") if len(rep.itl) else pd.DataFrame()
    spec = by_mode.loc["speculative"] if "speculative" in by_mode.index else None
    return {
        "spec.acceptance_rate": as_float(rep.summary["acceptance_rate"].iloc[0]),
        "spec.draft_share_of_decode": as_float(rep.cost["draft_share_of_decode"].iloc[0]) if len(rep.cost) else math.nan,
        "spec.rejected_draft_share": (as_float(rep.rejected["rejected_draft_share"].iloc[0]) if len(rep.rejected)
                                      else math.nan),
        "spec.ms_per_token": as_float(spec["ms_per_token"]) if spec is not None else math.nan,
        "spec.mean_itl": as_float(spec["mean_itl_ms"]) if spec is not None else math.nan,
    }
