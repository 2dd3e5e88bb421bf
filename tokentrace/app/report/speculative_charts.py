"""The speculative-decoding charts, drawn the same in the HTML report and the dashboard.

Each builder takes plotly's ``graph_objects`` module (imported by the caller, so
importing this module costs nothing) and frames of an
``analyzers.speculative.SpecReport``, and returns a figure without size or
template (each caller applies its own layout). Colours are the stage palette's
(:mod:`tokentrace.palette`): speculative work in ``decode.verify``'s and
``decode.draft``'s colours, plain decode steps in ``decode.compute``'s.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from tokentrace.palette import WORSE_COLOUR, stage_colour
from tokentrace.schema import Stage, col

__all__ = ["acceptance_figure", "accepted_per_step_figure", "itl_by_batch_figure", "cost_figure", "batch_label",
           "SPEC_COLOUR", "PLAIN_COLOUR", "DRAFT_COLOUR"]

SPEC_COLOUR = stage_colour(Stage.DECODE_VERIFY)
DRAFT_COLOUR = stage_colour(Stage.DECODE_DRAFT)
PLAIN_COLOUR = stage_colour(Stage.DECODE_COMPUTE)
_OUTLINE = "#555555"  # edges and hatching, so that the pale draft colour stands out on white


def batch_label(lo: Any, hi: Any) -> str:
    """A batch-size bin as a person reads it: ``1``, ``2``, ``3-4``, ``5-8``."""
    lo, hi = int(lo), int(hi)
    return str(hi) if lo == hi else f"{lo}-{hi}"


def acceptance_figure(go: Any, by_position: pd.DataFrame) -> Any:
    """Per draft position: bars of the share of steps whose proposal there was accepted, and a dotted line of the
    same among the steps whose previous proposal was accepted."""
    fig = go.Figure()
    x = [f"position {int(p)}" for p in by_position["position"]]
    steps = by_position["num_steps"].astype(int).tolist()
    fig.add_bar(name="accepted (of the steps that proposed it)", x=x, y=by_position["acceptance_rate"].astype(float).tolist(),
                marker_color=SPEC_COLOUR, customdata=steps, texttemplate="%{y:.0%}", textposition="outside",
                hovertemplate="%{x}: %{y:.1%} accepted of %{customdata:,} steps<extra></extra>")
    fig.add_scatter(name="accepted when the position before was", x=x,
                    y=by_position["conditional_acceptance_rate"].astype(float).tolist(), mode="lines+markers",
                    line=dict(color=SPEC_COLOUR, dash="dot"),
                    marker=dict(symbol="diamond", size=11, color=SPEC_COLOUR, line=dict(width=1.5, color="#ffffff")),
                    hovertemplate="%{x}: %{y:.1%} accepted when the one before was<extra></extra>")
    fig.update_layout(title="Acceptance by draft position", yaxis_title="share of steps",
                      yaxis_tickformat=".0%", yaxis_range=[0, 1.12], xaxis_type="category")
    return fig


def accepted_per_step_figure(go: Any, hist: pd.DataFrame) -> Any:
    """Bars: the share of verify steps that accepted 0, 1, 2, ... proposals."""
    fig = go.Figure()
    fig.add_bar(name="verify steps", x=[str(int(a)) for a in hist[col.NUM_ACCEPTED]], y=hist["share"].astype(float).tolist(),
                customdata=hist["num_steps"].astype(int).tolist(), marker_color=SPEC_COLOUR,
                texttemplate="%{y:.0%}", textposition="outside",
                hovertemplate="%{x} accepted: %{customdata:,} steps (%{y:.1%})<extra></extra>")
    fig.update_layout(title="Accepted proposals per verify step", showlegend=False, xaxis_type="category",
                      xaxis_title="proposals accepted in the step", yaxis_title="share of verify steps",
                      yaxis_tickformat=".0%", yaxis_rangemode="nonnegative")
    return fig


def itl_by_batch_figure(go: Any, by_batch: pd.DataFrame) -> Any:
    """Per batch-size bin: measured mean ITL of speculative and of plain decode tokens (bars) and the amortized
    step time per token of each (markers); bins where speculation was slower are marked."""
    fig = go.Figure()
    x = [batch_label(lo, hi) for lo, hi in zip(by_batch["batch_size_lo"], by_batch["batch_size_hi"])]
    for mode, colour, tokens in (("spec", SPEC_COLOUR, "spec_tokens"), ("plain", PLAIN_COLOUR, "plain_tokens")):
        name = "speculative" if mode == "spec" else "plain"
        counts = by_batch[tokens].astype(int).tolist()
        fig.add_bar(name=f"{name}: mean ITL", x=x, y=by_batch[f"{mode}_mean_itl_ms"].astype(float).tolist(),
                    marker_color=colour, customdata=counts,
                    hovertemplate=f"batch %{{x}}: {name} mean ITL %{{y:,.3~r}} ms over %{{customdata:,}} tokens"
                                  "<extra></extra>")
        fig.add_scatter(name=f"{name}: amortized step time per token", x=x,
                        y=by_batch[f"{mode}_ms_per_token"].astype(float).tolist(), mode="markers",
                        marker=dict(symbol="diamond", size=11, color=colour, line=dict(width=1.5, color="#ffffff")),
                        hovertemplate=f"batch %{{x}}: {name} %{{y:,.3~r}} ms of step time per token<extra></extra>")
    top = pd.concat([by_batch[c].astype(float) for c in ("spec_mean_itl_ms", "plain_mean_itl_ms",
                                                          "spec_ms_per_token", "plain_ms_per_token")]).max()
    for label, slower in zip(x, by_batch["slower"].astype(bool)):
        if slower:
            fig.add_annotation(x=label, y=float(top) * 1.08, text="speculation slower", showarrow=False,
                               font=dict(color=WORSE_COLOUR))
    fig.update_layout(title="ITL by batch size: speculative against plain decode tokens", barmode="group",
                      xaxis_type="category", xaxis_title="sequences in the step (batch size bin)", yaxis_title="ms",
                      yaxis_rangemode="nonnegative", yaxis_tickformat=",~r")
    return fig


def cost_figure(go: Any, cost: pd.DataFrame, rejected: pd.DataFrame) -> Any:
    """One stacked horizontal bar: decode compute time split into accepted drafting, rejected drafting, verify
    and plain decode steps, as shares (ms in the hover)."""
    c, r = cost.iloc[0], rejected.iloc[0]
    total = float(c["draft_ms"]) + float(c["verify_ms"]) + float(c["plain_compute_ms"])
    rejected_ms = float(r["rejected_draft_ms"])
    parts = (("draft, accepted proposals", float(c["draft_ms"]) - rejected_ms, DRAFT_COLOUR, ""),
             ("draft, rejected proposals", rejected_ms, DRAFT_COLOUR, "x"),
             ("verify", float(c["verify_ms"]), SPEC_COLOUR, ""),
             ("plain decode steps", float(c["plain_compute_ms"]), PLAIN_COLOUR, ""))
    fig = go.Figure()
    for name, ms, colour, pattern in parts:
        share = ms / total if total > 0 else 0.0
        fig.add_bar(name=name, y=["decode compute"], x=[share], orientation="h", customdata=[ms],
                    marker=dict(color=colour, line=dict(width=1, color=_OUTLINE),
                                pattern=dict(shape=pattern, fgcolor=_OUTLINE, size=6)),
                    texttemplate="%{x:.0%}" if share >= 0.04 else "", textposition="inside",
                    hovertemplate=f"{name}: %{{x:.1%}} (%{{customdata:,.1f}} ms)<extra></extra>")
    fig.update_layout(title="Draft cost: share of decode compute time", barmode="stack", legend_traceorder="normal",
                      xaxis_tickformat=".0%", xaxis_range=[0, 1], yaxis_showticklabels=False)
    return fig
