"""``tokentrace dashboard``: bad stores are one sentence and exit 2; loopback by default."""

from __future__ import annotations

import inspect

from typer.testing import CliRunner

from tokentrace.app.cli import app, register_commands
from tokentrace.app.cli.commands.dashboard import dashboard_command

register_commands(app)
runner = CliRunner()


def test_missing_store_is_one_sentence_and_exit_2(tmp_path):
    result = runner.invoke(app, ["dashboard", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_empty_store_is_one_sentence_and_exit_2(tmp_path):
    result = runner.invoke(app, ["dashboard", str(tmp_path)])
    assert result.exit_code == 2
    assert "is empty" in result.output


def test_binds_loopback_by_default():
    assert inspect.signature(dashboard_command).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(dashboard_command).parameters["port"].default == 8050
