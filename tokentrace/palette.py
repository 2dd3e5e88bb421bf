"""The one stage palette: the colour of every stage in the dashboard, the reports and the trace export.

Seventeen stages cannot all be told apart by every reader, so the palette is built
for what charts need: stages are drawn in pipeline order (stacked bars, a
waterfall's lanes), so **neighbours in that order** must differ most. The colours
come from Paul Tol's colour-blind-safe schemes (bright, muted, light, vibrant, pale, dark) and
Okabe-Ito's, assigned so that, in normal vision and simulated protanopia,
deuteranopia and tritanopia (Machado et al. 2009), stages next to each other in
:class:`~tokentrace.schema.Stage` order (``unattributed`` after ``stream.send``) are
at least 20 CIELAB units apart, stages two apart at least 15, and every pair at
least 8 (``tests/tokentrace/test_palette.py`` checks it). Some meaning is kept:
the two queues are warm (sand, orange), preemption is red, compute is dark (wine
for prefill, indigo for decode, dark brown for a speculative verify pass, whose cheap draft is
pale cyan), unattributed time is grey.

A trace in Chrome's JSON format cannot carry an RGB colour: chrome://tracing takes
one of its reserved colour names (``cname``) and ui.perfetto.dev colours slices by
a hash of their name. :data:`TRACE_COLOUR_NAMES` maps each stage to the nearest
reserved name, distinct per stage.

Charts whose series are not stages (percentiles, verdicts, cache tiers, runs) take their
colours, in order, from :data:`SERIES_COLOURS` (Okabe and Ito's colour-blind-safe set: every
pair at least 15 CIELAB units apart in all four views), and a change is drawn
:data:`WORSE_COLOUR` (vermillion) or :data:`BETTER_COLOUR` (blue), never red against green.

Part of the core (imports the schema only), so every layer may use it.
"""

from __future__ import annotations

from tokentrace.schema import UNATTRIBUTED_LABEL, Stage

__all__ = ["STAGE_COLOURS", "UNATTRIBUTED_COLOUR", "UNKNOWN_COLOUR", "TRACE_COLOUR_NAMES", "SERIES_COLOURS",
           "WORSE_COLOUR", "BETTER_COLOUR", "UNCHANGED_COLOUR", "stage_colour", "label_colour"]

STAGE_COLOURS: dict[Stage, str] = {
    Stage.GATEWAY_ACCEPT: "#AA4499",  # purple
    Stage.GATEWAY_RECEIVE: "#EE6677",  # rose
    Stage.GATEWAY_TOKENIZE: "#88CCEE",  # light cyan
    Stage.GATEWAY_ROUTE: "#117733",  # green
    Stage.SCHEDULE_QUEUE: "#EEDD88",  # sand (waiting)
    Stage.CACHE_LOOKUP: "#44AA99",  # teal
    Stage.CACHE_LOAD: "#999933",  # olive
    Stage.PREFILL_COMPUTE: "#882255",  # wine (compute)
    Stage.TRANSFER_KV: "#77AADD",  # light blue
    Stage.DECODE_QUEUE: "#E69F00",  # orange (waiting)
    Stage.DECODE_DRAFT: "#CCEEFF",  # pale cyan (cheap proposals)
    Stage.DECODE_VERIFY: "#663333",  # dark brown (a target pass, dark like compute)
    Stage.DECODE_COMPUTE: "#332288",  # indigo (compute)
    Stage.SCHEDULE_PREEMPTED: "#CC3311",  # red
    Stage.DETOKENIZE: "#BBCC33",  # pear
    Stage.STREAM_RELAY: "#4477AA",  # blue
    Stage.STREAM_SEND: "#EE8866",  # salmon
}
"""Stage -> ``#RRGGBB``; iterate :class:`~tokentrace.schema.Stage` for pipeline order."""

UNATTRIBUTED_COLOUR = "#BBBBBB"
"""Time no stage covers (``unattributed``): grey."""
UNKNOWN_COLOUR = "#DDDDDD"
"""A label that is neither a stage nor ``unattributed``."""

SERIES_COLOURS: tuple[str, ...] = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000",
                                   "#F0E442")
"""Colours of a chart's series in order (blue, orange, bluish green, reddish purple, sky blue, vermillion,
black, yellow): a plotly ``colorway`` for every chart that is not of stages."""
WORSE_COLOUR = "#D55E00"
"""A significant regression (vermillion)."""
BETTER_COLOUR = "#0072B2"
"""A significant improvement (blue)."""
UNCHANGED_COLOUR = "#999999"
"""A change that is not significant (grey)."""

TRACE_COLOUR_NAMES: dict[Stage, str] = {
    Stage.GATEWAY_ACCEPT: "detailed_memory_dump",
    Stage.GATEWAY_RECEIVE: "rail_animation",
    Stage.GATEWAY_TOKENIZE: "thread_state_runnable",
    Stage.GATEWAY_ROUTE: "good",
    Stage.SCHEDULE_QUEUE: "cq_build_running",
    Stage.CACHE_LOOKUP: "background_memory_dump",
    Stage.CACHE_LOAD: "olive",
    Stage.PREFILL_COMPUTE: "thread_state_uninterruptible",
    Stage.TRANSFER_KV: "rail_response",
    Stage.DECODE_QUEUE: "rail_idle",
    Stage.DECODE_DRAFT: "thread_state_sleeping",
    Stage.DECODE_VERIFY: "thread_state_unknown",
    Stage.DECODE_COMPUTE: "light_memory_dump",
    Stage.SCHEDULE_PREEMPTED: "terrible",
    Stage.DETOKENIZE: "cq_build_passed",
    Stage.STREAM_RELAY: "generic_work",
    Stage.STREAM_SEND: "cq_build_failed",
}
"""Stage -> the nearest of chrome://tracing's reserved colour names (the trace event's ``cname``)."""


def stage_colour(stage: Stage) -> str:
    """The ``#RRGGBB`` colour of ``stage``."""
    return STAGE_COLOURS[stage]


def label_colour(label: str) -> str:
    """The colour of a stage by its dotted label; ``unattributed`` grey; anything else a pale grey."""
    if label == UNATTRIBUTED_LABEL:
        return UNATTRIBUTED_COLOUR
    try:
        return STAGE_COLOURS[Stage.from_label(label)]
    except ValueError:
        return UNKNOWN_COLOUR
