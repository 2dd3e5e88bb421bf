"""The demo's default trace ships with the package, with its origin and licence."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokentrace.app.bench.workloads import load_trace
from tokentrace.app.cli import app, register_commands
from tokentrace.app.demo import BUNDLED_TRACE_ROWS, DemoOptions, _trace_path, bundled_trace

HEAD = Path(__file__).resolve().parents[3] / "data" / "mooncake_conversation_head100.jsonl"  # the trace's head


def test_the_bundled_trace_is_the_head_of_the_mooncake_trace_unchanged() -> None:
    bundled = bundled_trace().read_bytes()
    assert bundled == b"".join(HEAD.read_bytes().splitlines(keepends=True)[:BUNDLED_TRACE_ROWS])
    assert len(load_trace(bundled_trace()).requests) == BUNDLED_TRACE_ROWS == DemoOptions().num_requests
    folder = bundled_trace().parent
    readme = (folder / "README.md").read_text()
    assert "kvcache-ai/Mooncake" in readme and "Apache" in readme
    assert "Apache License" in (folder / "LICENSE-Apache-2.0.txt").read_text()


def test_the_default_needs_nothing_beside_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENTRACE_TRACES", str(tmp_path / "no-traces-here"))
    assert _trace_path(DemoOptions()) == bundled_trace()
    with pytest.raises(ValueError, match="needs more than the 80 bundled requests") as err:
        _trace_path(DemoOptions(num_requests=81))
    assert "kvcache-ai/Mooncake" in str(err.value) and "--sessions chat" in str(err.value)


def test_a_missing_trace_names_its_origin_and_the_workloads_without_one(tmp_path: Path) -> None:
    register_commands()
    result = CliRunner().invoke(app, ["demo", "--store", str(tmp_path / "st"), "--trace",
                                      str(tmp_path / "nope.jsonl"), "--no-dashboard"])
    assert result.exit_code == 2
    assert "trace file not found" in result.output
    assert "Mooncake" in result.output and "Apache-2.0" in result.output and "--sessions chat" in result.output
    assert "Traceback" not in result.output


def test_the_wheel_carries_the_trace() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[4] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["tokentrace.app.demo"]
    folder = bundled_trace().parent
    shipped = {p.name for pattern in patterns for p in folder.parent.glob(pattern)}
    assert {bundled_trace().name, "README.md", "LICENSE-Apache-2.0.txt"} <= shipped


def test_the_bench_names_a_missing_traces_origin_and_the_workloads_without_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokentrace.app.bench.plan import resolve_workload_path

    monkeypatch.setenv("TOKENTRACE_TRACES", str(tmp_path))
    with pytest.raises(ValueError) as err:
        resolve_workload_path("mooncake")
    message = str(err.value)
    assert "kvcache-ai/Mooncake" in message and "Apache-2.0" in message
    assert "--workload synthetic" in message and "--sessions chat" in message
