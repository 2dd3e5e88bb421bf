"""Session workloads: planning (mixes, think times, sessions rebuilt from a trace) and running them
over real HTTP: every turn's prompt is the previous prompt, the previous answer and new input,
turns wait the think time after the previous answer, and the headers carry the session."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from instrument.reference_engine import EngineTracer
from instrument.reference_gateway import GatewayTracer
from reference_server.engine.config import EngineConfig
from reference_server.serving.backend import LocalBackend
from reference_server.serving.gateway import GatewayConfig, create_app
from tokentrace.app.bench.client import RequestOptions
from tokentrace.app.bench.runner import RunLimits
from tokentrace.app.bench.sessions import (
    MIXES,
    SessionMix,
    ThinkTime,
    TurnSpec,
    build_session_plan,
    mix_sessions,
    run_sessions,
    trace_sessions,
)
from tokentrace.app.bench.synthetic import LengthDist
from tokentrace.app.bench.workloads import Scaling, TraceRequest, Workload, default_traces_dir, read_mooncake_jsonl
from tokentrace.app.cli.commands.bench import bench_command
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import REQUESTS, CacheEventKind, Role, col
from tokentrace.store import open_run
from tokentrace.store.writer import StoreWriter

torch.set_num_threads(1)
DATA = Path(__file__).resolve().parents[3] / "data"


@pytest.mark.parametrize(("spec", "expected"), [
    ("fixed:1.5", [1.5, 1.5]),
    ("uniform:2-2", [2.0, 2.0]),
])
def test_think_time_parses_and_samples(spec, expected):
    assert ThinkTime.parse(spec).sample(2, np.random.default_rng(0)).tolist() == expected


@pytest.mark.parametrize("spec", ["", "fixed:", "uniform:3-1", "exp:mean=-1", "gamma:1", "lognormal:sigma=1"])
def test_bad_think_times_are_refused_with_a_sentence(spec):
    with pytest.raises(ValueError, match="think time"):
        ThinkTime.parse(spec)


def test_mixes_scale_lengths_and_think_times():
    mix = SessionMix("t", LengthDist.parse("fixed:3"), LengthDist.parse("fixed:100"), LengthDist.parse("fixed:10"),
                     LengthDist.parse("fixed:20"), ThinkTime.parse("fixed:2"))
    (turns, start), = mix_sessions(mix, 1, length_scale=0.5, time_scale=0.25)
    assert [len(t.new_input) for t in turns] == [50, 5, 5]
    assert [t.max_tokens for t in turns] == [10, 10, 10] and [t.think_s for t in turns] == [0.5, 0.5, 0.5]
    agent, chat = MIXES["agent"], MIXES["chat"]
    assert agent.opening.a > chat.opening.a and agent.answer.b < chat.answer.a  # long contexts, short tool calls


def test_sessions_are_rebuilt_from_a_trace_by_hash_id_prefix():
    reqs = (TraceRequest(0.0, 10, 4, (1, 2)), TraceRequest(1.0, 9, 3, (7,)),
            TraceRequest(5.0, 20, 2, (1, 2, 3)), TraceRequest(9.0, 30, 1, (1, 2, 3, 4)),
            TraceRequest(9.5, 6, 1, (1, 8)))  # shares only block 1 (a system prompt): its own session
    made = trace_sessions(Workload(reqs, Scaling("t")), block_tokens=4)
    assert len(made) == 3
    (first, start0), (second, start1), (third, start2) = made
    assert (start0, start1, start2) == (0.0, 1.0, 9.5)
    # turn 1 adds 20 - (10 + 4) = 6 tokens; turn 2 adds 30 - (20 + 2) = 8; think = the trace's gaps
    assert [len(t.new_input) for t in first] == [10, 6, 8] and [t.think_s for t in first] == [5.0, 4.0, 0.0]
    # openings follow the hash ids: the shared block's 4 tokens are the same text, the next block's are not
    assert first[0].new_input[:4] == third[0].new_input[:4] and first[0].new_input[4:6] != third[0].new_input[4:6]
    head = trace_sessions(read_mooncake_jsonl(DATA / "mooncake_conversation_head100.jsonl", length_scale=1 / 64))
    assert len(head) == 100  # the file's first 100 requests share no more than the system prompt's block


def test_the_mooncake_conversation_trace_holds_multi_turn_sessions():
    path = default_traces_dir() / "mooncake_conversation.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    made = trace_sessions(read_mooncake_jsonl(path, max_requests=3000))
    assert sum(len(t) for t, _ in made) == 3000
    multi = [t for t, _ in made if len(t) > 1]
    assert len(multi) > 100 and all(turn.think_s >= 0 for t in multi for turn in t)


def test_a_session_plan_draws_starts_and_names_sessions():
    made = [([TurnSpec("a", 1, 0.0)], 0.0)] * 3
    plan = build_session_plan(made, session_rate=float("inf"), key_prefix="p")
    assert [s.start_s for s in plan.sessions] == [0.0, 0.0, 0.0]
    assert [s.session_id for s in plan.sessions] == ["p-sess00000", "p-sess00001", "p-sess00002"]
    with pytest.raises(ValueError, match="session-rate"):
        build_session_plan(made, session_rate=-1.0)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_turn_extends_the_previous_prompt_and_answer_after_the_think_time(recording_server, endpoint):
    url, seen, _ = recording_server
    turns = [TurnSpec("hello ", 3, 0.2), TurnSpec("more ", 2, 0.0)]
    plan = build_session_plan([(turns, 0.0)], session_rate=float("inf"), key_prefix="x")
    result, sent = run_sessions(plan, RequestOptions(url, endpoint=endpoint, model="ok"), RunLimits(duration_s=30))
    assert len(result.outcomes) == 2 and all(o.ok for o in result.outcomes)
    assert [h["headers"]["x-session-id"] for h in seen] == ["x-sess00000"] * 2
    assert [h["headers"]["x-session-turn"] for h in seen] == ["0", "1"]
    if endpoint == "completions":
        assert [h["body"]["prompt"] for h in seen] == ["hello ", "hello abcmore "]  # the fake answers a, b, c...
    else:
        assert seen[1]["body"]["messages"] == [{"role": "user", "content": "hello "},
                                               {"role": "assistant", "content": "abc"},
                                               {"role": "user", "content": "more "}]
    first, second = sorted(result.outcomes, key=lambda o: o.send_ns)
    assert second.send_ns - first.finish_ns >= 0.2e9  # the think time, after the answer completed
    assert [r.session_turn for r in sent] == [0, 1]


def test_agent_sessions_on_the_reference_server_record_sessions_and_full_reuse(serve_app, tmp_path):
    """The reference server keeps every session's blocks (retention keep): each later turn's carried
    prefix is served from the cache; the gateway and engine rows carry the session and turn."""
    backend = LocalBackend(EngineConfig(model="tiny", block_size=16, num_device_blocks=512, kv_retention="keep"))
    writer = StoreWriter(tmp_path, run_id="sess")
    rec = BufferedRecorder(writer, instance_id=writer.instance_id, flush_interval_s=0.05)
    rec.instance(role=Role.COLOCATED, name="server")
    backend.engine.add_observer(EngineTracer(rec))
    app = create_app(backend, config=GatewayConfig(), observers=[GatewayTracer(rec)])
    mix = SessionMix("agent", LengthDist.parse("fixed:3"), LengthDist.parse("fixed:40"),
                     LengthDist.parse("fixed:8"), LengthDist.parse("fixed:4"), ThinkTime.parse("fixed:0.05"))
    plan = build_session_plan(mix_sessions(mix, 2), session_rate=float("inf"), key_prefix="a")
    with serve_app(app) as url:
        result, _ = run_sessions(plan, RequestOptions(url, model="tiny"), RunLimits(duration_s=60),
                                 store=tmp_path, run_id="sess")
        deadline = time.monotonic() + 10
        while backend.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
    rec.close()
    assert len(result.outcomes) == 6 and all(o.ok for o in result.outcomes)
    rows = open_run(tmp_path / "sess").table(REQUESTS.name).to_pylist()
    sessions = {(r[col.SESSION], r[col.SESSION_TURN]) for r in rows if r[col.SESSION_TURN] is not None}
    assert sessions == {(f"a-sess0000{s}", t) for s in (0, 1) for t in (0, 1, 2)}  # client and gateway rows
    engine_rows = [r for r in rows if r[col.SESSION] and r[col.SESSION_TURN] is None]
    assert len(engine_rows) == 6  # the engine knows the session, not the turn number

    from analyzers.sessions import session_turns
    from analyzers.source import Source

    turns = session_turns(Source.of_run(open_run(tmp_path / "sess")))
    later = turns[turns["turn"] > 0]
    assert len(later) == 4 and (later["carried_tokens"] >= 32).all()  # at least the 41-token opening's 2 blocks
    assert (later["reused_tokens"] == later["carried_tokens"]).all() and (later["lost_tokens"] == 0).all()
    events = open_run(tmp_path / "sess").table("cache_events").to_pylist()
    assert any(e[col.KIND] == CacheEventKind.RETAIN for e in events)


_cli = typer.Typer()
_cli.command()(bench_command)


def test_the_bench_command_runs_sessions_and_records_them(recording_server, tmp_path):
    url, seen, _ = recording_server
    r = CliRunner().invoke(_cli, ["--url", url, "--sessions", "chat", "--num-sessions", "2", "--turns", "fixed:2",
                                  "--think-time", "fixed:0.01", "--session-rate", "inf", "--length-scale", "0.05",
                                  "--store", str(tmp_path), "--run", "cli", "--model", "ok"])
    assert r.exit_code == 0, r.output
    assert "2 chat sessions: fixed 2 turns" in r.output and "2 sessions, 4 turns" in r.output
    assert sorted(h["headers"]["x-session-turn"] for h in seen) == ["0", "0", "1", "1"]
    rows = open_run(tmp_path / "cli").table(REQUESTS.name).to_pylist()
    assert sorted((r[col.SESSION][-9:], r[col.SESSION_TURN]) for r in rows) == [
        ("sess00000", 0), ("sess00000", 1), ("sess00001", 0), ("sess00001", 1)]


@pytest.mark.parametrize(("args", "message"), [
    (["--sessions", "meeting"], "unknown --sessions 'meeting'; choose agent, chat or trace"),
    (["--sessions", "agent", "--think-time", "soon"], "bad think time 'soon'"),
    (["--sessions", "agent", "--num-sessions", "0"], "--num-sessions must be >= 1"),
    (["--sessions", "trace", "--workload", "nowhere.jsonl"], "trace file nowhere.jsonl not found"),
])
def test_bad_session_options_are_one_sentence(fake_url, args, message):
    r = CliRunner().invoke(_cli, ["--url", fake_url, *args])
    assert r.exit_code == 2 and message in r.output, r.output
