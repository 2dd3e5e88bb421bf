"""The diagnosis in words and as JSON: one request's story, the first screen's "why", ``tokentrace why --format json``.

Pure functions of ``analyzers.diagnosis.Diagnosis`` frames (no I/O), shared by the report's
first lines, ``tokentrace why`` and the dashboard's overview and request explorer, so that all
of them say the same thing in the same words.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from tokentrace.app.report.frames import as_float
from tokentrace.schema import col

__all__ = ["slo_verdict", "cause_lines", "request_story", "request_json", "causes_json", "NUM_FIRST_SCREEN_CAUSES"]

NUM_FIRST_SCREEN_CAUSES = 4  # causes named on the first screen ...
MIN_FIRST_SCREEN_SHARE = 0.01  # ... that explain at least 1% of the missed time
MIN_STORY_SHARE = 0.01  # a cause under 1% of a request's excess is only named, in one closing "Also" sentence
_TARGET_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def _missed_counts(requests: pd.DataFrame) -> dict[str, int]:
    counts = {k: 0 for k in _TARGET_NAMES}
    for missed in requests["missed"]:
        for k in str(missed).split(","):
            if k in counts:
                counts[k] += 1
    return {k: v for k, v in counts.items() if v}


def slo_verdict(diagnosis: Any) -> str:
    """Whether the targets were met: 'SLO MISSED: 25 of 40 ...' or 'SLO met: ...' (``diagnosis``: the analyzer's)."""
    judged, missed = int(diagnosis.num_judged), int(diagnosis.num_missed)
    if judged == 0:
        return "SLO not judged: no served request has a measured first token."
    if missed == 0:
        return f"SLO met: all {judged} served requests met their TTFT, TPOT and ITL targets."
    which = ", ".join(f"{_TARGET_NAMES[k]} {n}" for k, n in _missed_counts(diagnosis.requests).items())
    total = as_float(diagnosis.requests["excess_ms"].sum())
    return (f"SLO MISSED: {missed} of {judged} served requests ({missed / judged * 100:.0f}%) missed a target "
            f"({which}), {total:,.0f} ms over target in all.")


def cause_lines(diagnosis: Any, limit: int = NUM_FIRST_SCREEN_CAUSES) -> list[str]:
    """'Why #i: ...', one line per cause ranked by the share of missed time it explains (at most ``limit``, each at
    least ``MIN_FIRST_SCREEN_SHARE``), with an example and its fix; then 'Not explained: ...' when what no rule
    explains is among them."""
    summary = diagnosis.summary
    if summary is None or not len(summary):
        return []
    lines, rest = [], []
    big = summary[summary["share"].astype(float) >= MIN_FIRST_SCREEN_SHARE]
    shown = pd.concat([big[big["cause"] != "unknown"].head(limit), big[big["cause"] == "unknown"]])
    i = 0
    for r in shown.itertuples(index=False):
        if r.cause == "unknown":  # what no rule explains comes after the causes, unnumbered
            rest.append(f"Not explained: {as_float(r.share) * 100:.0f}% of the missed time has no cause in the trace "
                         f"(the requests' own work, or a cause no rule knows); e.g. {r.evidence}.")
            continue
        i += 1
        n = int(r.num_first)
        first = (f"the first cause of {n} request{'s' if n != 1 else ''}" if n else
                 f"named for {int(r.num_requests)} request{'s' if int(r.num_requests) != 1 else ''}, never first")
        text = f"Why #{i}: {_name(r)}, {as_float(r.share) * 100:.0f}% of the missed time, {first}; e.g. {r.evidence}."
        if r.fix:
            text += f" Fix: {r.fix}."
        lines.append(text)
    return lines + rest


def _ms(v: Any) -> str:
    x = as_float(v)
    return f"{x:,.1f} ms" if math.isfinite(x) else "unknown"


def request_story(request: pd.Series | dict, causes: pd.DataFrame) -> str:
    """One missed request's story in sentences: what it missed, by how much, then each cause with its fix."""
    r = dict(request)
    who = str(r.get(col.REQUEST_KEY) or r.get(col.REQUEST_ID))
    about = ", ".join(x for x in (f"tenant {r[col.TENANT]}" if r.get(col.TENANT) else "",
                                  f"class {r[col.SLO_CLASS]}" if r.get(col.SLO_CLASS) else "") if x)
    missed = []
    for key in str(r.get("missed", "")).split(","):
        if key == "ttft":
            missed.append(f"TTFT {_ms(r['ttft_ms'])} against {_ms(r['ttft_target_ms'])}")
        elif key == "tpot":
            missed.append(f"TPOT {_ms(r['tpot_ms'])} against {_ms(r['tpot_target_ms'])}")
        elif key == "itl":
            gaps = int(as_float(r['num_gaps_missed']))
            missed.append(f"ITL in {gaps} token gap{'s' if gaps != 1 else ''}, the longest "
                          f"{_ms(r['max_gap_ms'])} against {_ms(r['itl_target_ms'])}")
        elif key == "e2e":
            missed.append(f"E2E {_ms(r['e2e_ms'])} against {_ms(r['e2e_target_ms'])}")
    text = f"{who}" + (f" ({about})" if about else "") + f" missed {'; '.join(missed)}: {_ms(r['excess_ms'])} over target."
    ranked = list(causes.sort_values("rank").itertuples(index=False))
    minor = [c for c in ranked if as_float(c.share) < MIN_STORY_SHARE]  # NaN share: told in full
    told = 0
    for c in ranked:
        if as_float(c.share) < MIN_STORY_SHARE:
            continue
        if c.cause == "unknown":
            text += f" {_ms(c.ms)} ({as_float(c.share) * 100:.0f}%) has no cause in the trace (unknown)."
            continue
        lead = "It" if told == 0 else "Then it"  # every rule's evidence is a verb phrase about the request
        told += 1
        text += f" {lead} {c.evidence} ({c.cause}, {_ms(c.ms)} of the excess, {as_float(c.share) * 100:.0f}%)."
        if c.fix:
            text += f" Fix: {c.fix}."
    if minor:
        sums: dict[str, float] = {}
        for c in minor:  # one figure per cause as the story names it (a cause can come from several stages)
            sums[_name(c)] = sums.get(_name(c), 0.0) + as_float(c.ms)
        names = ", ".join(f"{name} {_ms(ms) if ms >= 0.05 else 'under 0.1 ms'}" for name, ms in sums.items())
        text += f" Also, each under {MIN_STORY_SHARE:.0%} of the excess: {names}."
    return text


def _name(c: Any) -> str:
    """A cause as a story names it: with its stage (``slow_stage``) or tenant where it has one."""
    return c.cause + (f" ({c.stage})" if c.cause == "slow_stage" and c.stage else "") + (
        f" (tenant {c.tenant})" if c.tenant else "")


def _cause_json(c: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"cause": c.cause, "ms": round(as_float(c.ms), 3), "share": round(as_float(c.share), 4),
                           "evidence": c.evidence, "fix": c.fix or None}
    if c.stage:
        out["stage"] = c.stage
    if c.tenant:
        out["tenant"] = c.tenant
    if c.requests:
        out["requests"] = [x for x in str(c.requests).split(", ") if x]
    return out


def request_json(request: pd.Series | dict, causes: pd.DataFrame) -> dict[str, Any]:
    """``{request_key, missed: [...], excess_ms, causes: [{cause, ms, share, evidence, fix, stage?, tenant?,
    requests?}]}``, first cause the largest."""
    r = dict(request)
    return {col.REQUEST_KEY: str(r.get(col.REQUEST_KEY) or r.get(col.REQUEST_ID)),  # "request_key"
            "missed": [k for k in str(r.get("missed", "")).split(",") if k],
            "excess_ms": round(as_float(r["excess_ms"]), 3),
            "causes": [_cause_json(c) for c in causes.sort_values("rank").itertuples(index=False)]}


def causes_json(diagnosis: Any) -> list[dict[str, Any]]:
    """The run's causes ranked by share of missed time, ``unknown`` last (the JSON report's ``diagnosis.causes``)."""
    out = []
    for r in diagnosis.summary.itertuples(index=False):
        item = {"cause": r.cause, "share": round(as_float(r.share), 4), "ms": round(as_float(r.ms), 3),
                "num_first": int(r.num_first), "num_requests": int(r.num_requests), "fix": r.fix or None,
                "evidence": r.evidence}
        if r.stage:
            item["stage"] = r.stage
        if r.tenant:
            item["tenant"] = r.tenant
        out.append(item)
    return out
