"""What-if in words and JSON: ``tokentrace whatif``'s output, and the report's capacity section.

The capacity section answers "at what request rate does the SLO break, and which setting moves that rate
most": it sweeps ``rate_scale`` (:data:`RATE_GRID`) under the run's own configuration and under each of
:data:`CANDIDATES` (one setting changed at a time), and names the highest rate at which at least the target
share (90%) of requests meet their SLO in each case. Every number comes from the simulator fitted to the
run (:mod:`analyzers.whatif`), whose error on the run itself is stated beside it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pandas as pd

from tokentrace.app.report.sections import Context, Section

__all__ = ["whatif_json", "whatif_lines", "metric_text", "error_text", "sweep_json", "sweep_lines", "whatif_section",
           "capacity_answer",
           "REPORT_REPLAYS", "REPORT_MAX_REQUESTS",
           "RATE_GRID", "CANDIDATES", "SHOWN_METRICS"]

RATE_GRID: tuple[float, ...] = tuple(round(0.25 * k, 2) for k in range(1, 17))
"""rate_scale values the capacity section sweeps: 0.25x to 4x the run's rate."""
REPORT_REPLAYS = 2
"""Replays averaged per point of the capacity section's sweeps (``tokentrace whatif`` averages five)."""
REPORT_MAX_REQUESTS = 2000
"""The capacity section replays at most the run's first this many served requests: five sweeps of sixteen
points stay seconds, not minutes, on a long run."""
SHOWN_METRICS: tuple[str, ...] = ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "e2e.p50", "e2e.p99",
                                  "slo.all.attainment", "load.served_rps")

CANDIDATES: tuple[tuple[str, Callable[[Any], dict[str, Any]]], ...] = (
    ("max_num_seqs x2", lambda e: {"max_num_seqs": 2 * e.max_num_seqs}),
    ("max_num_batched_tokens x2", lambda e: {"max_num_batched_tokens": 2 * e.max_num_batched_tokens}),
    ("num_device_blocks x2", lambda e: {"num_device_blocks": 2 * e.num_device_blocks}),
    ("one more instance", None),  # filled per deployment: instances + 1, or decode_instances + 1
)
"""The single-setting changes the capacity section tries (a function of the run's first engine)."""


def _ms(v: float) -> str:
    return "not measured" if not math.isfinite(v) else (f"{v:,.0f} ms" if v >= 100 else f"{v:,.1f} ms")


def metric_text(name: str, v: float) -> str:
    """A metric's value with its unit (ms, %, req/s); "not measured" when it is not finite."""
    if not math.isfinite(v):
        return "not measured"
    if name.endswith("attainment"):
        return f"{100 * v:.0f}%"
    if name.endswith("_rps"):
        return f"{v:.2f} req/s"
    return _ms(v)


def error_text(name: str, v: float) -> str:
    """A signed relative change or error in percent (an attainment's difference in points); "n/a" when not
    finite."""
    if not math.isfinite(v):
        return "n/a"
    pct = round(100 * v) or 0  # never "-0"
    return f"{pct:+d} points" if name.endswith("attainment") else f"{pct:+d}%"


def _number(x: float) -> str:
    """A table cell: thousands separators, three significant digits below 100, never scientific notation."""
    if not math.isfinite(x):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) >= 0.001 else "0"


def _worst(err: dict[str, float]) -> float:
    """The largest relative error of the latency metrics shown (ms metrics only)."""
    return max((abs(err[k]) for k in SHOWN_METRICS if k in err and math.isfinite(err[k])
                and not k.endswith("attainment") and not k.endswith("_rps")), default=math.nan)


def _settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "the run's own configuration"


def _engines_text(model: Any) -> str:
    parts = []
    for e in model.trace.engines:
        src = "read off its steps" if e.inferred else "recorded"
        parts.append(f"{e.role.label} (max_num_seqs {e.max_num_seqs}, max_num_batched_tokens "
                     f"{e.max_num_batched_tokens}, {e.num_device_blocks} KV blocks of {e.block_size}, "
                     f"{e.scheduling_policy}; {src})")
    return "; ".join(parts)


def fit_lines(model: Any, run_id: str) -> list[str]:
    """How the simulator was fitted and how well it replays the run itself."""
    m = model.models.all_steps
    n_ok = sum(1 for r in model.trace.requests if r.ok)
    lines = [
        f"Fitted to run {run_id}: {n_ok} served requests, {m.num_steps} engine steps; engines: {_engines_text(model)}.",
        f"Step time = {m.describe()} (mean error {100 * m.mape:.0f}% on the run's own steps); between busy steps "
        f"{m.gap_ns / 1e6:.2f} ms.",
    ]
    if m.heldout:
        lines.append(f"Step-time form {m.form}, chosen by its error on held-out steps (blocks of consecutive steps "
                     "each predicted by a fit on the others): " + ", ".join(
                         f"{form} {100 * err:.1f}%" for form, err in m.heldout) + ".")
    lines.append(_VARIATION_TEXT.get(m.variation, f"Step time varies around the model as the run's did ({m.variation})."))
    err = model.fit_error
    worst = _worst(err)
    replay = "; ".join(f"{k} {metric_text(k, model.measured.get(k, math.nan))} measured, "
                       f"{metric_text(k, model.fitted.get(k, math.nan))} replayed "
                       f"({error_text(k, err.get(k, math.nan))})"
                       for k in SHOWN_METRICS)
    lines.append(f"Replaying the run itself: {replay}. Largest latency error on the run itself: "
                 f"{'n/a' if not math.isfinite(worst) else f'{100 * worst:.0f}%'}.")
    lines.extend(f"Note: {n}." for n in model.notes)
    return lines


_VARIATION_TEXT = {
    "ratio": "Step time varies around the model by the run's own measured ratios, drawn at random with the run's "
             "persistence from step to step.",
    "residual": "Step time varies around the model by the run's own measured residuals, drawn at random.",
    "timeline": "Step time varies around the model as the run's did over the run (its slow and fast periods): "
                "the replay of the run keeps them where they were, and a prediction averages replays with them "
                "shifted along the run, since another load would not meet them at the same moments.",
}


def whatif_lines(model: Any, prediction: Any, run_id: str) -> list[str]:
    """``tokentrace whatif`` in sentences."""
    lines = fit_lines(model, run_id)
    changes = []
    for k in SHOWN_METRICS:
        now, then = model.fitted.get(k, math.nan), prediction.metrics.get(k, math.nan)
        if k.endswith("attainment"):
            rel = then - now if math.isfinite(now) and math.isfinite(then) else math.nan
        else:
            rel = (then - now) / now if now and math.isfinite(now) and math.isfinite(then) else math.nan
        changes.append(f"{k} {metric_text(k, then)} (replay of the run: {metric_text(k, now)}, {error_text(k, rel)})")
    lines.append(f"With {_settings_text(prediction.settings)}: " + "; ".join(changes) + ".")
    if prediction.num_preemptions:
        times = "time" if prediction.num_preemptions == 1 else "times"
        lines.append(f"The prediction preempts {prediction.num_preemptions} {times} for lack of KV blocks.")
    if prediction.num_unserved:
        lines.append(f"{prediction.num_unserved} requests would never be served (larger than the KV pool).")
    lines.extend(f"Note: {n}." for n in [*model.notes, *prediction.notes] if f"Note: {n}." not in lines)
    return lines


def _model_json(model: Any) -> dict[str, Any]:
    m = model.models
    steps = {role.label: {"intercept_ms": s.intercept_ns / 1e6, "per_prefill_token_ms": s.per_prefill_token_ns / 1e6,
                          "per_decode_token_ms": s.per_decode_token_ns / 1e6, "per_seq_ms": s.per_seq_ns / 1e6,
                          "per_context_token_ms": s.per_context_token_ns / 1e6, "form": s.form,
                          "variation": s.variation,
                          "form_ms": [v / 1e6 for v in s.concave_ns], "knots": list(s.knots),
                          "heldout_error": dict(s.heldout), "seqs_covered": [s.seqs_low, s.seqs_high],
                          "busy_gap_ms": s.gap_ns / 1e6, "num_steps": s.num_steps, "mape": s.mape}
             for role, s in m.step.items()}
    st = m.stages
    return {"step_time": steps, "first_delivery_ms": st.first_delivery_ns / 1e6, "delivery_ms": st.delivery_ns / 1e6,
            "handoff_ms": st.handoff_ns / 1e6 if st.has_handoff else None,
            "engines": [{"role": e.role.label, "max_num_seqs": e.max_num_seqs,
                         "max_num_batched_tokens": e.max_num_batched_tokens, "block_size": e.block_size,
                         "num_device_blocks": e.num_device_blocks, "scheduling_policy": e.scheduling_policy,
                         "recorded": not e.inferred} for e in model.trace.engines]}


def whatif_json(model: Any, prediction: Any) -> dict[str, Any]:
    """``{"predicted", "fitted", "fit_error", ...}``: metric names and units of the report's ``metrics``."""
    return {"settings": prediction.settings, "predicted": prediction.metrics, "fitted": model.fitted,
            "measured": model.measured, "fit_error": model.fit_error,
            "num_preemptions": prediction.num_preemptions, "num_unserved": prediction.num_unserved,
            "predicted_range": {k: list(v) for k, v in prediction.ranges.items()},
            "notes": [*model.notes, *prediction.notes], "model": _model_json(model)}


def _offered_rps(model: Any) -> float:
    arrivals = sorted(r.arrival_ns for r in model.trace.requests if r.ok)
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return math.nan
    return (len(arrivals) - 1) / ((arrivals[-1] - arrivals[0]) / 1e9)


def sweep_json(model: Any, result: Any) -> dict[str, Any]:
    return {"sweep": {"name": result.name, "target_share": result.target_share,
                      "highest_meeting": result.highest_meeting, "breaking_value": result.breaking_value,
                      "points": [{"value": v, "predicted": p.metrics} for v, p in zip(result.values,
                                                                                    result.predictions)]},
            "fitted": model.fitted, "measured": model.measured, "fit_error": model.fit_error,
            "offered_rps": _offered_rps(model), "notes": list(model.notes), "model": _model_json(model)}


def sweep_frame(result: Any) -> pd.DataFrame:
    rows = []
    for v, p in zip(result.values, result.predictions):
        rows.append({result.name: v, **{k: p.metrics.get(k, math.nan) for k in SHOWN_METRICS}})
    return pd.DataFrame(rows)


def sweep_lines(model: Any, result: Any, run_id: str) -> list[str]:
    lines = fit_lines(model, run_id)
    frame = sweep_frame(result)
    lines.append(frame.to_string(index=False, float_format=_number))
    share = f"{100 * result.target_share:.0f}%"
    if result.highest_meeting is None:
        lines.append(f"No {result.name} in the sweep keeps {share} of requests within their SLO targets.")
    else:
        extra = ""
        if result.name == "rate_scale":
            rps = _offered_rps(model) * float(result.highest_meeting)
            extra = f" (about {rps:.2f} req/s offered)" if math.isfinite(rps) else ""
        breaks = ""
        if result.breaking_value is not None:
            breaks = f"; the SLO breaks at about {result.breaking_value:.2f}"
        lines.append(f"The highest {result.name} that keeps {share} of requests within their SLO targets: "
                     f"{result.highest_meeting}{extra}{breaks}.")
    return lines


def capacity_answer(model: Any) -> tuple[pd.DataFrame, str]:
    """Highest rate_scale meeting the SLO under the run's configuration and under each candidate change,
    and the sentence that names the setting that moves it most."""
    first = model.trace.engines[0]
    disagg = any(e.role.label == "prefill" for e in model.trace.engines)
    n_dec = sum(e.role.label == "decode" for e in model.trace.engines)
    rows = []
    base = model.sweep("rate_scale", list(RATE_GRID))
    rows.append({"setting": "as run", "highest_rate_scale": base.highest_meeting})
    for label, make in CANDIDATES:
        if make is None:
            change = {"decode_instances": n_dec + 1} if disagg else {"instances": len(model.trace.engines) + 1}
        else:
            change = make(first)
        r = model.sweep("rate_scale", list(RATE_GRID), change)
        rows.append({"setting": f"{label} ({_settings_text(change)})", "highest_rate_scale": r.highest_meeting})
    frame = pd.DataFrame(rows)
    offered = _offered_rps(model)
    frame["highest_offered_rps"] = [offered * v if v is not None and math.isfinite(offered) else math.nan
                                    for v in frame["highest_rate_scale"]]
    base_v = base.highest_meeting or 0.0
    gains = [((v or 0.0) - base_v, s) for s, v in zip(frame["setting"][1:], frame["highest_rate_scale"][1:])]
    best_gain, best = max(gains) if gains else (0.0, "")
    if base.highest_meeting is None:
        text = (f"Predicted: even at {RATE_GRID[0]}x the run's rate fewer than {100 * base.target_share:.0f}% of "
                f"requests meet their SLO under the run's configuration")
    else:
        breaks = next((v for v in RATE_GRID if v > base.highest_meeting), None)
        text = (f"Predicted: the SLO ({100 * base.target_share:.0f}% of requests within target) holds up to "
                f"{base.highest_meeting}x the run's rate"
                + (f" (about {offered * base.highest_meeting:.2f} req/s)" if math.isfinite(offered) else "")
                + (f" and breaks by {breaks}x" if breaks is not None else " and beyond the swept 4x"))
    if best_gain > 0:
        text += f"; the setting that moves it most is {best}, to {base_v + best_gain:g}x"
    else:
        text += "; none of the single changes tried moves it"
    worst = _worst(model.fit_error)
    text += (f". The simulator's largest latency error on this run itself is "
             f"{'n/a' if not math.isfinite(worst) else f'{100 * worst:.0f}%'} (tokentrace whatif shows each).")
    return frame, text


def whatif_section(ctx: Context) -> Section:
    """The report's capacity answer (see the module doc)."""
    from analyzers.whatif import fit_whatif
    from tokentrace.schema import STEPS

    title = "Capacity (what-if)"
    if ctx.rows.get(STEPS.name, 0) == 0:
        return Section("whatif", title, "Not available: the run has no steps rows to fit an engine model to.")
    source = getattr(ctx.analysis, "source", None)
    if source is None:
        return Section("whatif", title, "Not available: the analysis has no source to fit the simulator to.")
    try:
        model = fit_whatif(source, num_replays=REPORT_REPLAYS, max_requests=REPORT_MAX_REQUESTS)
    except ValueError as err:
        return Section("whatif", title, f"Not available: {err}.")
    frame, text = capacity_answer(model)
    return Section("whatif", title, text, (("Highest rate meeting the SLO, per setting", frame),))
