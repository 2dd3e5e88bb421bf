"""Every command that reads a store takes it as STORE or as --store (as run, bench and demo do); help is plain."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokentrace.app.cli import app, register_commands
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import Role
from tokentrace.store import StoreWriter

runner = CliRunner()


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    writer = StoreWriter(tmp_path / "st", run_id="r-1")
    rec = BufferedRecorder(writer, instance_id=writer.instance_id, flush_interval_s=600)
    rec.instance(role=Role.GATEWAY, name="gateway-0")
    rid = rec.request_begin("req-0", arrival_ns=1_000)
    rec.token(rid, 0, sent_ns=2_000)
    rec.request_end(rid, first_token_ns=2_000, finish_ns=3_000, num_output_tokens=1)
    rec.close()
    return tmp_path / "st"


@pytest.mark.parametrize("command", [["runs"], ["inspect"], ["report"], ["export", "--out", "{tmp}/trace.json"]])
def test_the_store_is_an_argument_or_an_option(store: Path, command: list[str]) -> None:
    register_commands()
    args = [a.replace("{tmp}", str(store.parent)) for a in command]
    positional = runner.invoke(app, [*args, str(store)])
    option = runner.invoke(app, [*args, "--store", str(store)])
    assert positional.exit_code == 0, positional.output
    assert option.exit_code == 0, option.output
    if command[0] != "export":
        assert option.stdout == positional.stdout


@pytest.mark.parametrize("command", ["runs", "inspect", "report", "export", "dashboard"])
def test_no_store_or_two_stores_is_one_line_and_exit_2(store: Path, command: str) -> None:
    register_commands()
    neither = runner.invoke(app, [command])
    assert neither.exit_code == 2 and "give the store folder" in neither.output
    both = runner.invoke(app, [command, str(store), "--store", str(store.parent)])
    assert both.exit_code == 2 and "two stores given" in both.output
    assert "Traceback" not in neither.output + both.output


def test_help_keeps_brackets_and_shows_no_bool_metavar() -> None:
    register_commands()
    report_help = runner.invoke(app, ["report", "--help"]).stdout
    assert "pip install 'tokentrace[spark]'" in " ".join(report_help.split())
    run_help = runner.invoke(app, ["run", "--help"]).stdout
    assert "--derive / --no-derive" in run_help and "<bool>" not in run_help
