"""Figure builders: what they draw from a result frame."""

from __future__ import annotations

import pandas as pd

from dashboard.components import figures


def test_long_lines_are_drawn_without_markers_and_short_ones_with() -> None:
    short = pd.DataFrame({"t": range(10), "v": range(10)})
    long = pd.DataFrame({"t": range(5_000), "v": range(5_000)})
    assert [t.mode for t in figures.lines(short, "t", ["v"], title="").data] == ["lines+markers"]
    fig = figures.lines(long, "t", ["v"], title="")
    assert [t.mode for t in fig.data] == ["lines"]
    assert 300 < len(fig.data[0].x) <= 5_000  # downsampled, extremes kept, still a line


def test_lines_by_group_get_one_trace_per_group_and_column() -> None:
    frame = pd.DataFrame({"t": [0, 1, 0, 1], "a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "g": ["x", "x", "y", "y"]})
    fig = figures.lines(frame, "t", ["a", "b"], title="", group="g")
    assert [t.name for t in fig.data] == ["x · a", "x · b", "y · a", "y · b"]
    assert list(fig.data[2].y) == [3, 4]



def test_series_that_are_not_stages_take_the_core_colour_blind_safe_colours_in_order() -> None:
    from tokentrace.palette import SERIES_COLOURS

    frame = pd.DataFrame({"x": ["a", "b"], "p50_ms": [1.0, 2.0], "p99_ms": [3.0, 4.0]})
    for fig in (figures.bars(frame, "x", ["p50_ms", "p99_ms"], title=""),
                figures.lines(frame, "x", ["p50_ms", "p99_ms"], title="")):
        assert list(fig.layout.colorway) == list(SERIES_COLOURS)
        assert all(t.marker.color is None for t in fig.data)  # drawn from the colorway, in order


def test_the_chart_tool_bar_keeps_download_zoom_pan_and_reset_only() -> None:
    graph = figures.graph(figures.bars(pd.DataFrame({"x": ["a"], "y": [1.0]}), "x", ["y"], title="t"), "g")
    removed = set(graph.config["modeBarButtonsToRemove"])
    assert {"select2d", "lasso2d", "zoomIn2d", "zoomOut2d"} <= removed
    assert not removed & {"toImage", "zoom2d", "pan2d", "resetScale2d"}
    assert graph.config["displaylogo"] is False
