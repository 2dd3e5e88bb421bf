"""The waterfall figure: one lane per process (named), one bar per stage interval in the palette's colour, one tick
per token per lane, an arrow per hand-over between processes, and a zoom to any token."""

from __future__ import annotations

import pandas as pd
from synthetic_store import write_run

from dashboard.components.waterfall import (
    HANDOVER_NAME,
    TICKS_PREFIX,
    request_name,
    token_intervals_ms,
    waterfall_figure,
)
from dashboard.data import DataSource, RequestTrace
from tokentrace.palette import STAGE_COLOURS
from tokentrace.schema import Role, Stage, col

BIG_ID = 4030198795875324637  # a real 63-bit instance id: never drawn


def _trace() -> RequestTrace:
    ms = 1_000_000
    spans = pd.DataFrame({col.INSTANCE_ID: [1, 2, BIG_ID, BIG_ID], col.STAGE: [int(Stage.GATEWAY_RECEIVE),
                          int(Stage.PREFILL_COMPUTE), int(Stage.DECODE_COMPUTE), int(Stage.DECODE_COMPUTE)],
                          col.TOKEN_INDEX: [0, 0, 1, 2], col.START_NS: [0, 1 * ms, 5 * ms, 9 * ms],
                          col.END_NS: [1 * ms, 5 * ms, 9 * ms, 13 * ms]})
    tokens = pd.DataFrame({col.INSTANCE_ID: [2, BIG_ID, BIG_ID, 3, 3, 3], col.TOKEN_INDEX: [0, 1, 2, 0, 1, 2],
                           col.EMIT_NS: [5 * ms, 9 * ms, 13 * ms, None, None, None],
                           col.SENT_NS: [None] * 6, col.RECV_NS: [None, None, None, 6 * ms, 10 * ms, 14 * ms]})
    requests = pd.DataFrame({col.INSTANCE_ID: [1, 2, 3], col.ARRIVAL_NS: [0, 1 * ms, -ms],
                             col.FINISH_NS: [13 * ms, 13 * ms, 14 * ms], col.REQUEST_KEY: ["chat-7", "chat-7", ""]})
    instances = pd.DataFrame({col.INSTANCE_ID: [1, 2, BIG_ID, 3], col.ROLE: [int(Role.GATEWAY), int(Role.PREFILL),
                              int(Role.DECODE), int(Role.CLIENT)], col.NAME: ["gw", "prefill-0", "decode-0", "cli"]})
    return RequestTrace(7, spans, tokens, requests, instances)


def test_lanes_are_named_bars_and_ticks_of_a_hand_made_request():
    fig = waterfall_figure(_trace())
    ticks = {t.name: list(t.x) for t in fig.data if t.name.startswith(TICKS_PREFIX)}
    assert ticks == {TICKS_PREFIX + "prefill-0": [6.0], TICKS_PREFIX + "decode-0": [10.0, 14.0],
                     TICKS_PREFIX + "client · cli": [7.0, 11.0, 15.0]}
    decode = next(t for t in fig.data if t.name == "decode.compute")
    assert list(decode.base) == [6.0, 10.0] and list(decode.x) == [4.0, 4.0]  # ms from the client's send at -1 ms
    assert decode.marker.color == STAGE_COLOURS[Stage.DECODE_COMPUTE]  # the one palette
    client = next(t for t in fig.data if t.name.startswith("client:"))
    assert list(client.base) == [0.0] and list(client.x) == [15.0]
    assert list(fig.layout.yaxis.categoryarray) == ["client · cli", "decode-0", "prefill-0", "gateway · gw"]
    assert fig.layout.title.text == "Request chat-7"  # the request's own key, not its 63-bit id
    assert str(BIG_ID) not in fig.to_json()


def test_hand_overs_between_processes_are_arrows_from_one_lane_to_the_next():
    fig = waterfall_figure(_trace())
    (arrows,) = [t for t in fig.data if t.name == HANDOVER_NAME]
    # gateway.receive (gateway) -> prefill.compute (prefill): one hand-over, from 1 ms to 2 ms on the axis
    assert list(arrows.x) == [2.0, 2.0, None] and list(arrows.y) == ["gateway · gw", "prefill-0", None]
    assert list(arrows.marker.size) == [0, 11, 0] and arrows.marker.symbol == "arrow"


def test_zoom_to_a_token_sets_the_axis_to_its_interval():
    trace = _trace()
    assert token_intervals_ms(trace) == {0: (1.0, 6.0), 1: (6.0, 10.0), 2: (10.0, 14.0)}
    fig = waterfall_figure(trace, focus_token=1)
    lo, hi = fig.layout.xaxis.range
    assert lo < 6.0 < 10.0 < hi and hi - lo < 6.0
    assert waterfall_figure(trace).layout.xaxis.range is None


def test_waterfall_of_a_stored_request_has_one_tick_per_output_token(tmp_path):
    run = write_run(tmp_path, "w", num_requests=8, seed=5)
    src = DataSource(tmp_path)
    for i in (0, 3, 7):
        trace = src.request_trace("w", int(run.request_ids[i]))
        fig = waterfall_figure(trace)
        counts = [len(t.x) for t in fig.data if t.name.startswith(TICKS_PREFIX)]
        assert counts == [int(run.num_output_tokens[i])] * 2
        assert request_name(trace) == f"req-{i}"
        handovers = [t for t in fig.data if t.name == HANDOVER_NAME]
        # gateway -> engine at admission, engine -> gateway for each token's send
        assert len(handovers[0].x) == 3 * (1 + int(run.num_output_tokens[i]))
