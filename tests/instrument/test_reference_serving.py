"""The reference serving stack traced end to end: in-process (LocalBackend) and as a
whole deployment under ``tokentrace run`` (colocated workers; disaggregated prefill and
decode workers, one of them with a planted clock skew)."""

from __future__ import annotations

import logging
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pandas as pd
import pytest
import torch

import tokentrace
from analyzers.stage_breakdown import unattributed_share as analyzer_unattributed_share
from instrument.reference_gateway import trace_id_of
from reference_server.engine import EngineConfig
from reference_server.serving.backend import LocalBackend
from reference_server.serving.delays import DelayConfig
from reference_server.serving.gateway import GatewayConfig, create_app
from reference_server.serving.gateway_server import serve_in_thread
from tokentrace.clock import align
from tokentrace.schema import TOKENS, RequestStatus, Role, Stage, col, request_id_of

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the serving_tiling and deployments helpers
from deployments import traced_server  # noqa: E402
from serving_tiling import clipped_stage_times, handover_ns, load, unattributed_share  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
MAX_TOKENS = 8



def engine_config() -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=512, max_num_seqs=16,
                        max_num_batched_tokens=512)


def send_requests(url: str, n: int, *, stream: bool = True, headers: dict | None = None,
                  max_tokens: int = MAX_TOKENS, first: int = 0) -> list[int]:
    """``n`` sequential completions (distinct prompts, numbered from ``first``); their HTTP statuses."""
    statuses = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(first, first + n):
            body = {"model": "tiny", "prompt": f"request {i} " + "lorem ipsum " * (2 + i), "max_tokens": max_tokens,
                    "stream": stream, "ignore_eos": True, "temperature": 0}
            with c.stream("POST", "/v1/completions", json=body, headers=headers or {}) as r:
                for _ in r.iter_lines():
                    pass
                statuses.append(r.status_code)
    return statuses


@contextmanager
def local_app(store: Path, run: str, delay: str = "") -> Iterator[tuple[str, tokentrace.Handle]]:
    delays = DelayConfig.parse(delay)
    app = create_app(LocalBackend(engine_config(), delays=delays), config=GatewayConfig(delays=delays))
    handle = tokentrace.instrument(app, store=store, run=run, flush_interval_s=0.2)
    try:
        with serve_in_thread(app) as server:
            yield server.url, handle
    finally:
        handle.close()


def assert_no_overlap_within_instance(spans: pd.DataFrame) -> None:
    """Spans one process recorded for one token never overlap (exact tiling inside a process)."""
    keys = [col.INSTANCE_ID, col.REQUEST_ID, col.TOKEN_INDEX]
    s = spans[spans[col.TOKEN_INDEX] >= 0].sort_values(keys + [col.START_NS])
    prev_end = s.groupby(keys)[col.END_NS].shift()
    overlap = (prev_end - s[col.START_NS]).fillna(0)
    assert (overlap <= 0).all(), s[overlap > 0].head()
    assert (s[col.END_NS] > s[col.START_NS]).all()


# ---------------------------------------------------------------------- in-process gateway + engine


def test_local_stack_tiles_every_token_and_keeps_the_gateway_view(tmp_path: Path) -> None:
    with local_app(tmp_path, "local") as (url, handle):
        assert send_requests(url, 4, headers={"traceparent": TRACEPARENT}) == [200] * 4
        assert send_requests(url, 1, stream=False) == [200]
    t = load(tmp_path, "local")
    times = clipped_stage_times(t)
    assert len(times) == 4 * MAX_TOKENS + MAX_TOKENS  # non-streamed tokens count on emit times
    assert unattributed_share(times) < 0.01
    assert analyzer_unattributed_share(t["spans"], t["requests"], t["tokens"], t["instances"]) < 0.01
    spans = t["spans"].to_pandas()
    assert_no_overlap_within_instance(spans)
    labels = {Stage(s).label for s in spans[col.STAGE]}
    assert {"gateway.receive", "gateway.tokenize", "gateway.route", "schedule.queue", "prefill.compute",
            "decode.compute", "detokenize", "stream.send"} <= labels
    req = t["requests"].to_pandas()
    inst = t["instances"].to_pandas()
    assert list(inst[col.ROLE].unique()) == [Role.COLOCATED]
    gw = req[req[col.TRACE_ID] != ""]  # the gateway's rows carry the client's trace id
    assert len(gw) == 4 and set(gw[col.TRACE_ID]) == {trace_id_of(TRACEPARENT)}
    for _, row in req.groupby(col.REQUEST_ID):
        assert len(row) == 2  # gateway row + engine row, joined by request_id_of(key)
        assert row[col.REQUEST_KEY].nunique() == 1
        assert request_id_of(row[col.REQUEST_KEY].iloc[0]) == row[col.REQUEST_ID].iloc[0]
        assert (row[col.STATUS] == RequestStatus.OK).all()
        assert (row[col.NUM_OUTPUT_TOKENS] == MAX_TOKENS).all()
    # Analyzers see the gateway's view: arrival = headers received, first token = first chunk sent.
    tok = t["tokens"].to_pandas()
    sent0 = tok[(tok[col.TOKEN_INDEX] == 0) & tok[col.SENT_NS].notna()].set_index(col.REQUEST_ID)[col.SENT_NS]
    starts = times[times[col.TOKEN_INDEX] == 0].set_index(col.REQUEST_ID)
    for rid, first_sent in sent0.items():
        rows = req[req[col.REQUEST_ID] == rid]
        assert starts.loc[rid, "token_start_ns"] == rows[col.ARRIVAL_NS].min()
        assert starts.loc[rid, "token_end_ns"] == first_sent
        gw_row = rows[rows[col.TRACE_ID] != ""].iloc[0]
        assert gw_row[col.ARRIVAL_NS] == rows[col.ARRIVAL_NS].min()
        assert gw_row[col.FIRST_TOKEN_NS] == first_sent
    assert handle.counters["dropped"] == 0 and handle.counters["sink_errors"] == 0


# planted delay -> (stage it must land in, token kind, baseline delay, output tokens). Baselines plant a
# smaller delay at the same stage where that keeps the same side of the pipeline the slower
# one in both runs (decode_step: the engine; detokenize: the gateway). Otherwise the engine
# runs ahead in one run and part of each token's relay to the gateway hides behind the
# previous token's send, while in the other it is visible: a real, but different, split.
# The TTFT case asks for one token, so no decode step competes with the first token's relay
# to the event loop for the GIL.
STAGE_OF_DELAY = {
    "tokenize=30ms": ("gateway.tokenize", "ttft", "", 1),
    "schedule=25ms": ("schedule.queue", "ttft", "", 1),
    "decode_step=22ms": ("decode.compute", "itl", "decode_step=2ms", MAX_TOKENS),
    "detokenize=20ms": ("detokenize", "itl", "detokenize=5ms", MAX_TOKENS),
}


def _typical(times: pd.DataFrame, kind: str) -> pd.Series:
    """Per stage, its 10th-percentile time over the tokens of the kind (ms).

    A low quantile, because the noise of a shared machine only ever adds time (a woken
    thread waiting for a core, the event loop waiting up to the GIL's 5 ms switch interval
    for a token the engine thread emitted) while a planted delay shifts every occurrence.
    """
    rows = times[times[col.TOKEN_INDEX] == 0] if kind == "ttft" else times[times[col.TOKEN_INDEX] > 0]
    rows = rows[rows["stream.send"] > 0]  # tokens written as chunks (not held back for the next one)
    return rows[[s.label for s in Stage]].quantile(0.1) / 1e6


def _planted_ms(spec: str) -> float:
    """The nominal length of a fixed planted delay (ms); 0 for no delay."""
    return sum(d.low_ns for d in DelayConfig.parse(spec).stages.values()) / 1e6


@pytest.mark.parametrize("delay", list(STAGE_OF_DELAY))
def test_planted_delay_shows_up_in_its_stage_only(delay: str, tmp_path: Path) -> None:
    stage, kind, base, num_tokens = STAGE_OF_DELAY[delay]
    # Baseline and planted servers run side by side and take requests in turn, so the
    # load of a shared machine falls on both alike.
    with local_app(tmp_path, "base", base) as (base_url, _), local_app(tmp_path, "d", delay) as (url, _):
        for i in range(24 if kind == "ttft" else 10):  # one token 0 per request: more requests
            send_requests(base_url, 1, max_tokens=num_tokens, first=i)
            send_requests(url, 1, max_tokens=num_tokens, first=i)
    times = clipped_stage_times(load(tmp_path, "d"))
    assert unattributed_share(times) < 0.01
    delta = _typical(times, kind) - _typical(clipped_stage_times(load(tmp_path, "base")), kind)
    planted_ms = _planted_ms(delay) - _planted_ms(base)  # sleeps end late alike in both runs
    # A tenth of the planted delay is room for what a loaded machine does to compute stages (prefill.compute
    # moved by 2 ms between runs with both cores oversubscribed, and decode.compute by 1.9 ms of 20): a
    # misattribution would move a whole planted delay (15-30 ms).
    room = max(1.0, 0.1 * planted_ms)
    assert abs(delta[stage] - planted_ms) < room, (planted_ms, delta.round(3).to_dict())
    others = delta.drop(stage)  # no other stage absorbs the delay
    assert (others.abs() < room).all(), str(others.round(3).to_dict())


def test_unwritable_store_drops_counted_and_server_keeps_serving(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "store"
    with caplog.at_level(logging.WARNING, logger="tokentrace"):
        with local_app(store, "ro") as (url, handle):
            run_dir = store / "ro"
            shutil.rmtree(run_dir)
            run_dir.write_bytes(b"")  # the run folder is now a file: every write fails (even as root)
            assert send_requests(url, 3) == [200] * 3
            handle.flush()
            counters = handle.counters
    assert counters["sink_errors"] > 0  # rows lost to the failing store, counted
    warnings = [r for r in caplog.records if r.name == "tokentrace" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


# ---------------------------------------------------------------------- whole deployments, `tokentrace run`


def check_deployment(t: dict, times: pd.DataFrame, *, num_requests: int) -> None:
    """What every traced deployment must show."""
    req = t["requests"].to_pandas()
    spans = t["spans"].to_pandas()
    assert_no_overlap_within_instance(spans)
    gw_ids = set(req.loc[req[col.TRACE_ID] == trace_id_of(TRACEPARENT), col.REQUEST_ID])
    assert len(gw_ids) == num_requests
    assert set(req[col.REQUEST_ID]) == gw_ids  # every process keyed the requests alike: they join
    assert set(times[col.REQUEST_ID]) == gw_ids
    assert (times.groupby(col.REQUEST_ID).size() == MAX_TOKENS).all()
    latency = times["latency_ns"].sum()
    # Inside each process the tiling is exact; what is left unattributed lies exactly at the
    # cross-process hand-overs (after clock alignment), and it is small.
    gap = handover_ns(t, times)
    residual = times.set_index([col.REQUEST_ID, col.TOKEN_INDEX])["unattributed"] - gap
    assert residual.abs().sum() / latency < 0.001, residual.describe()
    # Measured 2-4% on a 2-core machine across worker processes (0% in one process): the
    # residual check above pins all of it to the cross-process hand-overs.
    assert unattributed_share(times) < 0.10


def test_colocated_cluster_under_tokentrace_run(tmp_path: Path) -> None:
    with traced_server(tmp_path, "colo", ["--mode", "colocated", "--instances", "2"]) as url:
        assert send_requests(url, 4, headers={"traceparent": TRACEPARENT}) == [200] * 4
    t = load(tmp_path, "colo")
    inst = t["instances"].to_pandas().groupby(col.INSTANCE_ID).last()
    assert sorted(inst[col.ROLE]) == [Role.GATEWAY, Role.COLOCATED, Role.COLOCATED]
    workers = inst[inst[col.ROLE] == Role.COLOCATED]
    assert sorted(workers[col.NAME]) == ["colocated-0", "colocated-1"]
    assert (workers[col.CLOCK_RTT_NS] > 0).all()  # each worker aligned itself to the gateway's clock
    assert (workers[col.CLOCK_OFFSET_NS].abs() <= workers[col.CLOCK_RTT_NS]).all()  # one host: ~0
    check_deployment(t, clipped_stage_times(t), num_requests=4)


SKEW_NS = 7_000_000_000  # decode-0's clock runs 7 s ahead (tests only)


def test_disaggregated_cluster_with_a_skewed_worker_clock(tmp_path: Path) -> None:
    env = {"TOKENTRACE_TEST_CLOCK_SKEW_NS": f"decode-0={SKEW_NS}"}
    args = ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--delay", "kv_transfer=20ms"]
    with traced_server(tmp_path, "pd", args, env) as url:
        assert send_requests(url, 4, headers={"traceparent": TRACEPARENT}) == [200] * 4
    t = load(tmp_path, "pd")
    inst = t["instances"].to_pandas().groupby(col.INSTANCE_ID).last()
    assert sorted(inst[col.ROLE]) == [Role.GATEWAY, Role.PREFILL, Role.DECODE]
    decode = inst[inst[col.ROLE] == Role.DECODE].iloc[0]
    assert abs(decode[col.CLOCK_OFFSET_NS] + SKEW_NS) <= decode[col.CLOCK_RTT_NS] / 2 + 1_000
    times = clipped_stage_times(t)
    check_deployment(t, times, num_requests=4)
    unaligned = clipped_stage_times(t, aligned=False)
    # The skew matters: without the offsets decode-0's spans fall 7 s away from their tokens and their time
    # goes unattributed. How much of the run's latency that is depends on the machine: on a CPU other processes
    # keep busy, the waits around them grow and it was 4% (5% or more on a quiet machine), so the margin is 1%.
    assert unattributed_share(unaligned) > unattributed_share(times) + 0.01
    # ...and alignment recovers the true order: prefill emits token 0, the KV moves (planted
    # 20 ms), decode emits token 1 before the gateway sends it.
    rtt = int(inst[col.CLOCK_RTT_NS].max())
    tok = align(t["tokens"], TOKENS.name, t["instances"]).to_pandas()
    for rid, g in tok.groupby(col.REQUEST_ID):
        emit0 = g[(g[col.TOKEN_INDEX] == 0) & g[col.EMIT_NS].notna()][col.EMIT_NS].iloc[0]
        emit1 = g[(g[col.TOKEN_INDEX] == 1) & g[col.EMIT_NS].notna()][col.EMIT_NS].iloc[0]
        # token 1's end at the gateway: its chunk, or its receipt if it completed no character
        # (the tiny model's bytes) and was held back for the next chunk
        end1 = g[(g[col.TOKEN_INDEX] == 1)][[col.SENT_NS, col.RECV_NS]].min().min()
        assert emit0 + 20_000_000 < emit1 <= end1 + rtt
    kv = t["spans"].to_pandas()
    kv = kv[kv[col.STAGE] == Stage.TRANSFER_KV]
    assert len(kv) >= 4 and (kv[col.NUM_BYTES] > 0).all() and (kv[col.TOKEN_INDEX] == 1).all()
    moved = kv.groupby(col.REQUEST_ID).apply(lambda g: (g[col.END_NS] - g[col.START_NS]).sum())
    assert (moved >= 20_000_000).all(), moved  # the planted 20 ms lands in transfer.kv
    # ...in the prefill worker's own piece: it slept before its first chunk left, so the time is its own
    prefill_id = inst.index[inst[col.ROLE] == Role.PREFILL][0]
    sender = kv[kv[col.INSTANCE_ID] == prefill_id]
    assert set(sender[col.REQUEST_ID]) == set(kv[col.REQUEST_ID])
    assert ((sender[col.END_NS] - sender[col.START_NS]) >= 20_000_000).all()
    assert kv[col.INSTANCE_ID].nunique() == 3  # sender, gateway (the wire) and receiver each hold their part
    one = times[times[col.TOKEN_INDEX] == 1].set_index(col.REQUEST_ID)
    stages = [s.label for s in Stage]
    assert (one[stages].idxmax(axis=1) == "transfer.kv").all()  # and it dominates token 1's interval
    loads = t["cache_events"].to_pandas()
    assert (loads[col.NUM_BYTES].dropna() > 0).any()  # the decode side's received bytes
