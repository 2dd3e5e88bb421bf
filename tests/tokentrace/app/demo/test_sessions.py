"""`tokentrace demo --sessions agent`, reduced (one session, the tiny model): the disaggregated reference server
keeps the session's KV between turns (retention keep), and the report says every carried token was reused."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from tokentrace.app.demo import DemoOptions, run_demo
from tokentrace.app.demo.server import ServerSpec, server_command

pytestmark = pytest.mark.timeout(300)


def _options(store: Path, **kw: object) -> DemoOptions:
    base = dict(store=store, model="tiny", dashboard=False, run="sessions", device="cpu", sessions="agent",
                num_sessions=1, session_rate=float("inf"), session_length_scale=0.125, time_scale=0.05,
                kv_retention="keep", load_duration_s=60.0, load_drain_s=30.0)
    base.update(kw)
    return DemoOptions(**base)  # type: ignore[arg-type]


def test_the_demo_runs_agent_sessions_on_the_disaggregated_server(tmp_path):
    out = io.StringIO()
    result = run_demo(_options(tmp_path / "demo-store"), console=Console(file=out, width=160, force_terminal=False))
    text = out.getvalue()
    assert result.num_sent == result.num_ok and result.num_sent >= 4  # a session of 4-8 turns
    assert "agent sessions" in text and "KV retention between turns: keep" in text
    assert "Sessions and KV retention between turns" in text and "No carried token was lost" in text
    m = result.report.metrics
    assert m["session.reuse_fraction"] == 1.0 and m["session.lost_tokens"] == 0
    roles = {i["role"] for i in result.report.run.instances}
    assert {"prefill", "decode", "gateway", "client"} <= roles


def test_a_bad_retention_policy_is_one_sentence_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="unknown --kv-retention 'forever'; choose one of lru, keep, offload, drop"):
        run_demo(_options(tmp_path / "demo-store", kv_retention="forever"), console=Console(file=io.StringIO()))
    assert not (tmp_path / "demo-store").exists()


def test_the_server_command_carries_the_retention_policy(tmp_path):
    spec = ServerSpec(store=tmp_path, run_id="r", tenants_file=tmp_path / "t.json", kv_retention="offload")
    argv = server_command(spec)
    assert argv[argv.index("--kv-retention") + 1] == "offload"
    assert "--kv-retention" not in server_command(ServerSpec(store=tmp_path, run_id="r", tenants_file=tmp_path))
