"""The waterfall figure: one lane per process, one bar per stage interval, one tick per token per lane."""

from __future__ import annotations

import pandas as pd
import pytest
from synthetic_store import write_run

from dashboard.components.waterfall import TICKS_PREFIX, stage_color, waterfall_figure
from dashboard.data import DataSource, RequestTrace
from tokentrace.schema import Role, Stage, col


def _trace() -> RequestTrace:
    ms = 1_000_000
    spans = pd.DataFrame({col.INSTANCE_ID: [1, 2, 2, 2], col.STAGE: [int(Stage.GATEWAY_RECEIVE),
                          int(Stage.PREFILL_COMPUTE), int(Stage.DECODE_COMPUTE), int(Stage.DECODE_COMPUTE)],
                          col.TOKEN_INDEX: [0, 0, 1, 2], col.START_NS: [0, 1 * ms, 5 * ms, 9 * ms],
                          col.END_NS: [1 * ms, 5 * ms, 9 * ms, 13 * ms]})
    tokens = pd.DataFrame({col.INSTANCE_ID: [2, 2, 2, 3, 3, 3], col.TOKEN_INDEX: [0, 1, 2, 0, 1, 2],
                           col.EMIT_NS: [5 * ms, 9 * ms, 13 * ms, None, None, None],
                           col.SENT_NS: [None] * 6, col.RECV_NS: [None, None, None, 6 * ms, 10 * ms, 14 * ms]})
    requests = pd.DataFrame({col.INSTANCE_ID: [1, 2, 3], col.ARRIVAL_NS: [0, 1 * ms, -ms],
                             col.FINISH_NS: [13 * ms, 13 * ms, 14 * ms]})
    instances = pd.DataFrame({col.INSTANCE_ID: [1, 2, 3], col.ROLE: [int(Role.GATEWAY), int(Role.DECODE),
                              int(Role.CLIENT)], col.NAME: ["gw", "dec", "cli"]})
    return RequestTrace(7, spans, tokens, requests, instances)


def test_lanes_bars_and_ticks_of_a_hand_made_request():
    fig = waterfall_figure(_trace())
    ticks = {t.name: list(t.x) for t in fig.data if t.name.startswith(TICKS_PREFIX)}
    assert ticks == {TICKS_PREFIX + "decode · dec": [6.0, 10.0, 14.0], TICKS_PREFIX + "client · cli": [7.0, 11.0, 15.0]}
    decode = next(t for t in fig.data if t.name == "decode.compute")
    assert list(decode.base) == [6.0, 10.0] and list(decode.x) == [4.0, 4.0]  # ms from the client's send at -1 ms
    client = next(t for t in fig.data if t.name.startswith("client:"))
    assert list(client.base) == [0.0] and list(client.x) == [15.0]
    assert list(fig.layout.yaxis.categoryarray) == ["client · cli", "decode · dec", "gateway · gw"]


def test_waterfall_of_a_stored_request_has_one_tick_per_output_token(tmp_path):
    run = write_run(tmp_path, "w", num_requests=8, seed=5)
    src = DataSource(tmp_path)
    for i in (0, 3, 7):
        fig = waterfall_figure(src.request_trace("w", int(run.request_ids[i])))
        counts = [len(t.x) for t in fig.data if t.name.startswith(TICKS_PREFIX)]
        assert counts == [int(run.num_output_tokens[i])] * 2


@pytest.mark.parametrize("stage", list(Stage))
def test_every_stage_has_its_own_colour(stage):
    others = {stage_color(s.label) for s in Stage if s is not stage}
    assert stage_color(stage.label) not in others
