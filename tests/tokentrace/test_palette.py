"""The stage palette: one colour per stage, neighbours in pipeline order far apart also for colour-blind readers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tokentrace.palette import (
    BETTER_COLOUR,
    SERIES_COLOURS,
    STAGE_COLOURS,
    TRACE_COLOUR_NAMES,
    UNATTRIBUTED_COLOUR,
    UNCHANGED_COLOUR,
    WORSE_COLOUR,
    label_colour,
    stage_colour,
)
from tokentrace.schema import UNATTRIBUTED_LABEL, Stage

# Machado, Oliveira and Fernandes (2009), severity 1, on linear RGB.
_CVD = {
    "protanopia": np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                            [-0.003882, -0.048116, 1.051998]]),
    "deuteranopia": np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                              [-0.011820, 0.042940, 0.968881]]),
    "tritanopia": np.array([[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602],
                            [0.004733, 0.691367, 0.303900]]),
}
_XYZ = np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
                 [0.0193339, 0.1191920, 0.9503041]])
_WHITE = np.array([0.95047, 1.0, 1.08883])
# chrome://tracing's reserved colour names (catapult's color_scheme)
_RESERVED = {"thread_state_uninterruptible", "thread_state_iowait", "thread_state_running", "thread_state_runnable",
             "thread_state_sleeping", "thread_state_unknown", "background_memory_dump", "light_memory_dump",
             "detailed_memory_dump", "vsync_highlight_color", "generic_work", "good", "bad", "terrible", "black",
             "grey", "white", "yellow", "olive", "rail_response", "rail_animation", "rail_idle", "rail_load",
             "startup", "heap_dump_stack_frame", "heap_dump_object_type", "heap_dump_child_node_highlight",
             "cq_build_running", "cq_build_passed", "cq_build_failed", "cq_build_abandoned",
             "cq_build_attempt_runnig", "cq_build_attempt_passed", "cq_build_attempt_failed"}


def _lab(linear: np.ndarray) -> np.ndarray:
    t = _XYZ @ np.clip(linear, 0, 1) / _WHITE
    f = np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _views(hex_colour: str) -> dict[str, np.ndarray]:
    """CIELAB of the colour in normal vision and under each simulated colour-vision deficiency."""
    srgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    linear = np.where(srgb <= 0.04045, srgb / 12.92, ((srgb + 0.055) / 1.055) ** 2.4)
    return {"normal": _lab(linear), **{k: _lab(m @ linear) for k, m in _CVD.items()}}


def _distance(a: str, b: str) -> float:
    """The smallest CIELAB distance between two colours over normal vision and the three deficiencies."""
    va, vb = _views(a), _views(b)
    return min(float(np.linalg.norm(va[k] - vb[k])) for k in va)


ORDER = [stage_colour(s) for s in Stage] + [UNATTRIBUTED_COLOUR]  # pipeline order, unattributed last


def test_every_stage_has_a_colour_and_they_are_all_different():
    assert set(STAGE_COLOURS) == set(Stage)
    assert len(set(ORDER)) == len(ORDER)
    for colour in ORDER:
        assert colour.startswith("#") and len(colour) == 7


@pytest.mark.parametrize("gap, minimum", [(1, 20.0), (2, 15.0)])
def test_stages_near_each_other_in_pipeline_order_stay_apart_for_colour_blind_readers(gap, minimum):
    close = [(i, _distance(ORDER[i], ORDER[i + gap])) for i in range(len(ORDER) - gap)]
    worst = min(close, key=lambda x: x[1])
    assert worst[1] >= minimum, f"colours {worst[0]} and {worst[0] + gap} are only {worst[1]:.1f} apart"


def test_every_pair_of_stages_is_told_apart():
    worst = min(_distance(a, b) for a, b in itertools.combinations(ORDER, 2))
    assert worst >= 8.0


def test_the_distance_would_catch_a_red_green_pair():
    red, green = "#B22222", "#6B8E23"  # far apart in normal vision, close for a deuteranope
    assert float(np.linalg.norm(_views(red)["normal"] - _views(green)["normal"])) > 80
    assert _distance(red, green) < 15
    assert _distance("#4477AA", "#4477AB") < 1


def test_labels_map_to_the_same_colours():
    for s in Stage:
        assert label_colour(s.label) == stage_colour(s)
    assert label_colour(UNATTRIBUTED_LABEL) == UNATTRIBUTED_COLOUR
    assert label_colour("no.such.stage") not in ORDER


def test_trace_colour_names_are_chromes_reserved_names_one_per_stage():
    assert set(TRACE_COLOUR_NAMES) == set(Stage)
    assert set(TRACE_COLOUR_NAMES.values()) <= _RESERVED
    assert len(set(TRACE_COLOUR_NAMES.values())) == len(Stage)


PLOTLY_DEFAULT_COLORWAY = ["#636efa", "#EF553B", "#00cc96", "#ab63fa", "#FFA15A", "#19d3f3", "#FF6692", "#B6E880"]


@pytest.mark.parametrize("colours, first", [(list(SERIES_COLOURS), 8), (PLOTLY_DEFAULT_COLORWAY, 4)])
def test_series_colours_are_told_apart_by_colour_blind_readers(colours, first):
    worst = min(_distance(a, b) for a, b in itertools.combinations(colours[:first], 2))
    if colours is PLOTLY_DEFAULT_COLORWAY:  # what a chart without the colorway would draw: its red and green merge
        assert worst < 15
    else:
        assert len(set(colours)) == len(colours) and worst >= 15


def test_a_change_is_never_drawn_red_against_green():
    assert _distance(WORSE_COLOUR, BETTER_COLOUR) >= 40
    assert min(_distance(UNCHANGED_COLOUR, c) for c in (WORSE_COLOUR, BETTER_COLOUR)) >= 20
    assert _distance("#d62728", "#2ca02c") < 40  # the red/green pair it replaces
