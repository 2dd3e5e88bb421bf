"""Perfetto export: structure against the trace-event format, clock alignment, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

import tokentrace
from tokentrace.app.cli import app, register_commands
from tokentrace.app.export import perfetto_trace
from tokentrace.palette import STAGE_COLOURS, TRACE_COLOUR_NAMES
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, STEPS, TOKENS, Role, Stage, col
from tokentrace.store import StoreWriter

torch.set_num_threads(1)
register_commands()
runner = CliRunner()
US = 1_000  # ns per microsecond
REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "i": {"name", "ph", "ts", "pid", "tid", "s"},
            "C": {"name", "ph", "ts", "pid", "args"}, "M": {"name", "ph", "pid", "args"}}
METADATA_NAMES = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


@pytest.fixture(scope="module")
def engine_store(tmp_path_factory) -> Path:
    """A real run: the tiny reference engine, instrumented, serving 4 requests of 5 tokens."""
    from reference_server.engine.config import EngineConfig
    from reference_server.engine.engine import Engine
    from reference_server.model import SamplingParams

    store = tmp_path_factory.mktemp("engine-store")
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=128))
    handle = tokentrace.instrument(engine, store=store, run="real")
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"req-{i}", f"a shared prompt, then question {i}", sampling)
    while engine.has_unfinished():
        engine.step()
    handle.close()
    engine.close()
    return store


def _table(t, rows: list[dict]) -> pa.Table:
    return pa.Table.from_pydict({c.name: [r.get(c.name) for r in rows] for c in t.columns}, schema=t.schema)


def _inst(iid: int, role: Role, name: str, offset: int) -> dict:
    return {col.INSTANCE_ID: iid, col.ROLE: int(role), col.NAME: name, col.HOST: "h", col.PID: 1,
            col.MONO_ANCHOR_NS: 0, col.WALL_ANCHOR_NS: 0, col.CLOCK_OFFSET_NS: offset}


def _span(iid: int, stage: Stage, start: int, end: int, idx: int = 0, rid: int = 5) -> dict:
    return {col.REQUEST_ID: rid, col.STAGE: int(stage), col.TOKEN_INDEX: idx, col.START_NS: start,
            col.END_NS: end, col.INSTANCE_ID: iid}


@pytest.fixture
def pd_store(tmp_path) -> Path:
    """Request 5 on a prefill instance (1, offset 0) then a decode instance (2, its clock 1 ms behind).

    Prefill: queue 0-100 us, prefill 100-300 us. Decode (local clock): transfer 0-50 us, decode
    50-80 us -> on the reference clock 1000-1050 and 1050-1080 us. One bad span (end < start).
    A client (instance 3) received token 1 at 1100 us.
    """
    with StoreWriter(tmp_path, run_id="pd") as w:
        w.write(INSTANCES, _table(INSTANCES, [_inst(1, Role.PREFILL, "p0", 0), _inst(2, Role.DECODE, "decode-d0",
                                                                                    1000 * US),
                                                  _inst(3, Role.CLIENT, "", 0)]))
        w.write(REQUESTS, _table(REQUESTS, [{col.REQUEST_ID: 5, col.REQUEST_KEY: "chat-5", col.INSTANCE_ID: 1,
                                             col.TENANT: "", col.SLO_CLASS: "", col.ARRIVAL_NS: 0, col.STATUS: 0}]))
        w.write(SPANS, _table(SPANS, [_span(1, Stage.SCHEDULE_QUEUE, 0, 100 * US),
                                      _span(1, Stage.PREFILL_COMPUTE, 100 * US, 300 * US),
                                      _span(2, Stage.TRANSFER_KV, 0, 50 * US, idx=1),
                                      _span(2, Stage.DECODE_COMPUTE, 50 * US, 80 * US, idx=1),
                                      _span(2, Stage.DETOKENIZE, 90 * US, 85 * US, idx=1)]))
        w.write(TOKENS, _table(TOKENS, [{col.REQUEST_ID: 5, col.TOKEN_INDEX: 1, col.EMIT_NS: 80 * US,
                                         col.INSTANCE_ID: 2},
                                        {col.REQUEST_ID: 5, col.TOKEN_INDEX: 1, col.RECV_NS: 1100 * US,
                                         col.INSTANCE_ID: 3}]))
        w.write(STEPS, _table(STEPS, [{col.INSTANCE_ID: 2, col.STEP: 1, col.START_NS: 50 * US, col.END_NS: 80 * US,
                                       col.NUM_SEQS: 1, col.NUM_PREFILL_TOKENS: 0, col.NUM_DECODE_TOKENS: 1,
                                       col.NUM_WAITING: 3, col.NUM_RUNNING: 1, col.NUM_PREEMPTED: 0,
                                       col.NUM_BLOCKS_USED_DEVICE: 7, col.NUM_BLOCKS_TOTAL_DEVICE: 64}]))
    return tmp_path


def check_trace_event_format(trace: dict) -> list[dict]:
    """Assert the JSON Object Format rules tokentrace relies on; returns the events."""
    json.dumps(trace, allow_nan=False)  # strict JSON: no NaN / inf
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] in ("ms", "ns")
    events = trace["traceEvents"]
    for e in events:
        assert REQUIRED[e["ph"]] <= e.keys(), e
        assert type(e["pid"]) is int and e["pid"] > 0
        assert type(e.get("tid", 0)) is int
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0
        if e["ph"] == "i":
            assert e["s"] in ("t", "p", "g")
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values())
        if e["ph"] == "M":
            assert e["name"] in METADATA_NAMES
    phases = [e["ph"] for e in events]
    first_timed = next(i for i, p in enumerate(phases) if p != "M")
    assert "M" not in phases[first_timed:], "metadata events come first"
    ts = [e["ts"] for e in events if e["ph"] != "M"]
    assert ts == sorted(ts) and ts[0] >= 0
    processes = {e["pid"] for e in events if e["name"] == "process_name" and e["args"]["name"]}
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name" and e["args"]["name"]}
    assert {e["pid"] for e in events} <= processes
    assert {(e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "i")} <= threads
    _check_nesting([e for e in events if e["ph"] == "X"])
    return events


def _check_nesting(slices: list[dict], eps: float = 1e-6) -> None:
    """On one track, complete events are disjoint or nested (what Perfetto's importer requires)."""
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in slices:
        tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in tracks.values():
        open_ends: list[float] = []
        for start, end in sorted(intervals, key=lambda se: (se[0], -se[1])):
            while open_ends and open_ends[-1] <= start + eps:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + eps, "slices overlap without nesting"
            open_ends.append(end)


def test_real_run_has_a_slice_per_span_an_instant_per_token_and_counters(engine_store):
    run = tokentrace.open(engine_store)
    events = check_trace_event_format(perfetto_trace(run))
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == run.num_rows(SPANS.name)
    assert {e["name"] for e in slices} <= {s.label for s in Stage}
    assert {Stage.PREFILL_COMPUTE.label, Stage.DECODE_COMPUTE.label} <= {e["name"] for e in slices}
    assert len([e for e in events if e["ph"] == "i"]) == run.num_rows(TOKENS.name) == 20
    assert {e["name"] for e in events if e["ph"] == "C"} == {"queue", "kv blocks used"}
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {f"req-{i}" for i in range(4)}
    (process,) = [e for e in events if e["name"] == "process_name"]
    assert process["args"]["name"].startswith("colocated-")


def test_tracks_per_instance_and_request_on_the_reference_clock(pd_store):
    trace = perfetto_trace(tokentrace.open(pd_store))
    events = check_trace_event_format(trace)
    procs = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(procs) == {"prefill-p0", "decode-d0", "client-3"}  # role-name, the role not repeated
    by_name = {e["name"]: e for e in events if e["ph"] == "X"}
    assert by_name["prefill.compute"]["ts"] == pytest.approx(100.0) and by_name["prefill.compute"]["dur"] == 200.0
    assert by_name["transfer.kv"]["ts"] == pytest.approx(1000.0)  # local 0 + 1 ms offset
    assert by_name["transfer.kv"]["pid"] == procs["decode-d0"] != by_name["prefill.compute"]["pid"]
    assert by_name["decode.compute"]["args"] == {"request": "chat-5", col.TOKEN_INDEX: 1,
                                                 "colour": STAGE_COLOURS[Stage.DECODE_COMPUTE]}
    # the one palette: the stage's colour, and the nearest colour name chrome://tracing takes
    assert by_name["decode.compute"]["cname"] == TRACE_COLOUR_NAMES[Stage.DECODE_COMPUTE]
    assert "detokenize" not in by_name and trace["otherData"]["skipped_spans"] == "1"
    token, received = [e for e in events if e["ph"] == "i"]
    assert token["ts"] == pytest.approx(1080.0) and token["tid"] == by_name["decode.compute"]["tid"]
    assert received["ts"] == pytest.approx(1100.0) and received["pid"] == procs["client-3"]
    counters = {e["name"]: e for e in events if e["ph"] == "C"}
    assert counters["queue"]["args"] == {"waiting": 3, "running": 1, "preempted": 0}
    assert counters["kv blocks used"]["args"] == {"device": 7}
    assert counters["queue"]["ts"] == pytest.approx(1050.0)


def test_cli_writes_a_file_perfetto_can_load(pd_store, tmp_path):
    out = tmp_path / "trace.json"
    result = runner.invoke(app, ["export", str(pd_store), "--run", "pd", "--format", "perfetto", "--out", str(out)])
    assert result.exit_code == 0, result.output
    check_trace_event_format(json.loads(out.read_text()))
    assert "ui.perfetto.dev" in result.stderr


def test_cli_writes_to_stdout_by_default(pd_store):
    result = runner.invoke(app, ["export", str(pd_store)])
    assert result.exit_code == 0, result.output
    assert len(check_trace_event_format(json.loads(result.stdout))) > 0


def _corrupt(store: Path) -> Path:
    part = next((store / "pd" / SPANS.name).rglob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:40])
    return store


@pytest.mark.parametrize("case,args,expected", [
    ("missing", lambda s, t: [str(t / "nowhere")], "does not exist"),
    ("empty", lambda s, t: [str(t)], "is empty"),
    ("unknown run", lambda s, t: [str(s), "--run", "nope"], "unknown run id 'nope'"),
    ("unknown format", lambda s, t: [str(s), "--format", "speedscope"], "unknown export format"),
    ("corrupt", lambda s, t: [str(_corrupt(s))], "unreadable file"),
])
def test_bad_input_is_one_sentence_and_exit_2(pd_store, tmp_path_factory, case, args, expected):
    empty = tmp_path_factory.mktemp("empty")
    result = runner.invoke(app, ["export", *args(pd_store, empty)])
    assert result.exit_code == 2, (case, result.output)
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")
    assert "Traceback" not in result.output


def test_a_run_with_nothing_to_draw_is_bad_input(tmp_path):
    with StoreWriter(tmp_path, run_id="bare") as w:
        w.write(REQUESTS, _table(REQUESTS, [{col.REQUEST_ID: 1, col.REQUEST_KEY: "r", col.INSTANCE_ID: 1,
                                             col.TENANT: "", col.SLO_CLASS: "", col.STATUS: 0}]))
    result = runner.invoke(app, ["export", str(tmp_path)])
    assert result.exit_code == 2 and "nothing to export" in result.stderr
